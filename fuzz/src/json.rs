//! `json_body`: the body parser (`radixgate::openai::BodyParser`) on arbitrary bytes.
//!
//! It must never panic: any input is either facts or a 400/404 error. Parsing is
//! deterministic (twice, same facts and blocks), and the prompt blocks it streams
//! into the hasher equal the blocks of its recorded canonical stream hashed in one
//! piece.

use radixgate::openai::{BodyParser, Endpoint, ModelTable};
use radixgate_orchestrator::PromptHasher;
use std::num::NonZeroUsize;

pub fn json_body(data: &[u8]) {
    let models = ModelTable::new(vec!["m".into(), "sim".into()]);
    let block = NonZeroUsize::new(16).unwrap();
    for endpoint in [Endpoint::ChatCompletions, Endpoint::Completions] {
        let mut first = PromptHasher::new(block);
        first.set_recording(true);
        let a = BodyParser.parse(endpoint, data, &models, &mut first, 7);
        let mut second = PromptHasher::new(block);
        let b = BodyParser.parse(endpoint, data, &models, &mut second, 7);
        match (&a, &b) {
            (Ok(x), Ok(y)) => {
                assert_eq!(x, y);
                assert_eq!(first.blocks(), second.blocks());
                let mut again = PromptHasher::new(block);
                again.reset(first.seed());
                again.feed(first.canonical());
                assert_eq!(again.blocks(), first.blocks(), "streamed vs one piece");
            }
            (Err(x), Err(y)) => {
                assert_eq!(x.code(), y.code());
                assert!(matches!(x.status(), 400 | 404), "{x}");
            }
            _ => panic!("parsing the same body twice disagreed: {a:?} / {b:?}"),
        }
    }
}
