//! `json_body`: the body parser (`radixgate::openai::BodyParser`) on arbitrary bytes.
//!
//! It must never panic: any input is either facts or a 400/404 error. Parsing is
//! deterministic (twice, same facts and blocks), and the prompt blocks it streams
//! into the hasher equal the blocks of its recorded canonical stream hashed in one
//! piece. And it agrees with the reference parser (sonic-rs, the parser before the
//! gateway's own scanner): the same facts and blocks, or an error of the same kind
//! (and the same param and message, except for the detail of malformed JSON).

use radixgate::openai::dom_reference::DomBodyParser;
use radixgate::openai::{BodyParser, Endpoint, ModelTable};
use radixgate_orchestrator::PromptHasher;
use std::num::NonZeroUsize;

pub fn json_body(data: &[u8]) {
    let models = ModelTable::new(vec!["m".into(), "sim".into()]);
    let block = NonZeroUsize::new(16).unwrap();
    for endpoint in [Endpoint::ChatCompletions, Endpoint::Completions] {
        let mut first = PromptHasher::new(block);
        first.set_recording(true);
        let a = BodyParser::default().parse(endpoint, data, &models, &mut first, 7);
        let mut second = PromptHasher::new(block);
        let b = BodyParser::default().parse(endpoint, data, &models, &mut second, 7);
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
        let mut reference = PromptHasher::new(block);
        match (
            &a,
            DomBodyParser.parse(endpoint, data, &models, &mut reference, 7),
        ) {
            (Ok(x), Ok(y)) => {
                assert_eq!(*x, y, "facts differ from the reference");
                assert_eq!(
                    first.blocks(),
                    reference.blocks(),
                    "blocks differ from the reference"
                );
            }
            (Err(x), Err(y)) => {
                assert_eq!((x.kind, &x.param), (y.kind, &y.param), "{x} / {y}");
                if x.kind != radixgate::error::ErrorKind::MalformedJson {
                    assert_eq!(x.message, y.message);
                }
            }
            (x, y) => panic!("the reference parser disagreed: {x:?} / {y:?}"),
        }
    }
}
