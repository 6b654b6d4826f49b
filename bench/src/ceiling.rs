//! The ceiling of a real-engine run: the prefix-cache hit rate an oracle router could
//! reach on the same requests with the same KV capacity.
//!
//! The oracle is one engine holding the whole fleet's capacity (the engines' block
//! counts summed) fed the run's requests in issue order: every prefix any request
//! shares with an earlier one is found, unless the pooled LRU cache has evicted it
//! since. No router over separate engines can share more, short of out-guessing LRU,
//! so `radixgate-bench real` reports each policy's engine hit rate against it.
//!
//! Prompts are the requests' chat messages in the gateway's canonical form
//! ([`PromptHasher`]), cut into blocks of the engine's block size in bytes
//! (`block_tokens` × bytes per token); only whole blocks count, as the engine caches
//! only whole blocks. The rate is in prompt bytes, the engines' in tokens: the two
//! agree to within the chat template's few tokens per message.

use std::num::NonZeroUsize;

use radixgate_orchestrator::{model_seed, EngineCache, PromptHasher};

use crate::workload::Workload;

/// The hit rate of requests `0..requests` of `workload` on one engine of
/// `capacity_blocks` blocks (`None`: unbounded) of `block_bytes` bytes each.
pub fn hit_rate(
    workload: &Workload,
    requests: u64,
    block_bytes: usize,
    capacity_blocks: Option<usize>,
) -> f64 {
    let block = NonZeroUsize::new(block_bytes.max(1)).expect("at least 1");
    let mut hasher = PromptHasher::new(block);
    let mut cache = EngineCache::new(capacity_blocks.unwrap_or(usize::MAX));
    let seed = model_seed(&workload.config().model);
    let (mut hit_bytes, mut prompt_bytes) = (0u64, 0u64);
    for i in 0..requests {
        hasher.reset(seed);
        for (role, content) in workload.messages(i) {
            hasher.feed_message(role, None, &content);
        }
        let blocks = hasher.blocks();
        hit_bytes += (cache.matched(blocks) * block_bytes) as u64;
        prompt_bytes += hasher.bytes_fed();
        cache.touch(blocks);
    }
    match prompt_bytes {
        0 => 0.0,
        total => hit_bytes as f64 / total as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{Kind, WorkloadConfig};

    fn docs(docs: usize, doc_bytes: usize) -> Workload {
        Workload::new(WorkloadConfig {
            kind: Kind::Docs,
            docs,
            doc_bytes,
            questions: 4,
            seed: 7,
            ..WorkloadConfig::default()
        })
    }

    #[test]
    fn only_each_documents_first_question_misses_without_a_bound() {
        let w = docs(3, 4000);
        let unbounded = hit_rate(&w, 60, 64, None);
        // 60 requests over 3 documents: a few cold misses, the rest mostly cached.
        assert!(unbounded > 0.8, "{unbounded}");
        assert!(unbounded < 1.0, "{unbounded}");
    }

    #[test]
    fn a_cache_smaller_than_the_working_set_lowers_the_ceiling() {
        let w = docs(6, 4000);
        let unbounded = hit_rate(&w, 120, 64, None);
        // Room for about two of the six documents.
        let small = hit_rate(&w, 120, 64, Some(2 * 4000 / 64));
        let none = hit_rate(&w, 120, 64, Some(0));
        assert!(small < unbounded - 0.1, "{small} vs {unbounded}");
        assert!(small > 0.0, "{small}");
        assert_eq!(none, 0.0);
    }
}
