"""Builds a small random-weight Llama model with a ChatML tokenizer, offline.

No weights can be downloaded on the machines radixgate is tested on, so the real-engine
tier serves a model made here: a byte-level BPE tokenizer trained on generated text and
a LlamaForCausalLM with random weights. Its output is gibberish; what matters is that
vLLM runs it with the real scheduler, prefix cache, metrics and KV events.

Usage: python make_model.py OUT_DIR [tiny|small|tokenizer]
  tiny      = hidden 256, 4 layers (functional tests)
  small     = hidden 512, 8 layers (benchmarks: the cache effect is clear)
  tokenizer = the tokenizer and chat template only (needs `tokenizers` and
              `transformers`, not torch): for benchmark clients and
              `radixgate demo --tokenizer` (perf/clients.sh)
"""

import os
import random
import sys

SIZES = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
    "small": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4),
}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def corpus(seed=7, lines=20000):
    rng = random.Random(seed)
    syll = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "de", "po", "an", "er",
            "in", "on", "us", "th", "qu", "el", "ar", "is"]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    words += ["the", "a", "of", "and", "to", "in", "is", "you", "that", "it", "document",
              "question", "answer", "system", "user", "assistant", "please", "summarize"]
    for _ in range(lines):
        n = rng.randint(5, 25)
        yield " ".join(rng.choice(words) for _ in range(n)) + rng.choice([".", "?", "!", ","])
    for i in range(2000):
        yield f"{i} {i * 7 % 1000} 0x{i:04x} {{\"k\": [{i}, {i + 1}]}}"


def make_tokenizer(out):
    """Trains the byte-level BPE tokenizer and saves it with its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None,
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    fast.save_pretrained(out)
    return fast


def main():
    out = sys.argv[1]
    size = sys.argv[2] if len(sys.argv) > 2 else "tiny"
    if os.path.exists(os.path.join(out, ".complete")):
        print(out)
        return
    os.makedirs(out, exist_ok=True)
    fast = make_tokenizer(out)
    if size == "tokenizer":
        open(os.path.join(out, ".complete"), "w").close()
        print(out)
        return

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(fast), max_position_embeddings=4096,
                      bos_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
                      eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
                      pad_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
                      tie_word_embeddings=True, torch_dtype="bfloat16", **SIZES[size])
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    open(os.path.join(out, ".complete"), "w").close()
    print(out)


if __name__ == "__main__":
    main()
