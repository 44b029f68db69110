#!/usr/bin/env python3
"""Makes the tiny model ferry's vLLM tests serve: python3 scripts/make_tiny_model.py DIR.

A Qwen3-architecture causal LM with random weights (transformers, fixed seed) and a byte-level
BPE tokenizer trained here with `tokenizers` on a small generated corpus, saved to DIR in the
format `vllm serve DIR` and `transformers.AutoModelForCausalLM.from_pretrained(DIR)` load, with
a chat template. Nothing is downloaded (run it with HF_HUB_OFFLINE=1). The same arguments give
the same files, so two machines serve the same model. Needs torch, transformers and tokenizers
(build/vllm-venv has them: scripts/vllm_venv.sh).

Defaults: 2 layers, hidden 256, 4 query heads and 2 KV heads of head_dim 64, vocabulary 2048,
max positions 16384, bf16 (about 3 MB of weights): small enough that a 2-core CPU prefills 8k
tokens in seconds, large enough that KV for each layer and head is distinct.
"""

import argparse
import json
import os
import random
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

WORDS = ("the a of to and in is was for on that with as by at from it be this which or are an "
         "prefill decode block cache token layer head engine request transfer push pull ferry "
         "river boat bank water stone bridge north south east west morning evening light dark "
         "one two three four five six seven eight nine ten hundred thousand number letter "
         "model memory network machine device write read send receive wait ready done").split()


def corpus(seed: int, lines: int):
    """Sentences of the word list and digits: enough text for a 2k-token BPE vocabulary."""
    rnd = random.Random(seed)
    for _ in range(lines):
        n = rnd.randint(4, 24)
        words = [rnd.choice(WORDS) if rnd.random() < 0.85 else str(rnd.randint(0, 99999))
                 for _ in range(n)]
        yield " ".join(words).capitalize() + rnd.choice([".", "?", "!", ","])


def make_tokenizer(out: str, vocab: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(seed, 20000), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token=None,
                                   unk_token=None, model_max_length=1 << 20)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="folder to write the model into (made if missing)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64, choices=[64, 128])
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--max-positions", type=int, default=16384)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args(argv)

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    os.makedirs(a.out, exist_ok=True)
    tok = make_tokenizer(a.out, a.vocab, a.seed)
    vocab = len(tok)  # the trainer may stop short of --vocab on a small corpus
    torch.manual_seed(a.seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 3,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads,
                      num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
                      max_position_embeddings=a.max_positions, rope_theta=1000000.0,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, bos_token_id=None,
                      # Larger than the usual 0.02, so that logits are well apart and greedy
                      # decoding does not hinge on last-bit differences between batch shapes.
                      initializer_range=0.2)
    model = Qwen3ForCausalLM(cfg).to(getattr(torch, a.dtype))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(a.out, safe_serialization=True)
    with open(os.path.join(a.out, "ferry_tiny_model.json"), "w") as f:
        json.dump({"made_by": "scripts/make_tiny_model.py", "args": vars(a)}, f, indent=1)
    print(f"tiny model: {a.out}: {a.layers} layers, {a.kv_heads} KV heads x {a.head_dim}, "
          f"vocabulary {vocab}, {sum(p.numel() for p in model.parameters())} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
