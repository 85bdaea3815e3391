"""Write a tiny Llama model directory a real SGLang engine serves with random weights (``--load-format dummy``).

Run by the engine's own interpreter (it needs ``tokenizers`` and ``transformers``, which kvgate does not):
    python make_model.py DIR [--profile tiny|mlp]
DIR gets config.json (LlamaForCausalLM) and a tokenizer built here, offline: a byte-level BPE trained with the
``tokenizers`` package on a built-in text, wrapped in transformers' PreTrainedTokenizerFast with a one-line chat
template, so /v1/completions and /v1/chat/completions work as well as /generate with token ids. The model's
vocab_size equals the tokenizer's, so every sampled id decodes to visible text (measured on SGLang 0.5.23: ids beyond the
tokenizer's vocabulary decode to nothing). ``<unk>`` ``<s>`` ``</s>`` are ids 0-2, the config's bos 1 / eos 2.

Profiles:
- ``tiny``: hidden 64, 2 layers. Fast (hundreds of tokens/s on one core); a cache hit saves almost nothing on
  the torch_native backend, which recomputes attention over the whole context. For the tests.
- ``mlp``: hidden 512, intermediate 4096, 8 layers, 4 heads of 64. MLP-heavy, so a radix-cache hit saves most
  of a prefill here too (74% measured on 1,000 ids); for ``kvgate bench`` on real engines.
Idempotent: a directory whose files match is left alone. Prints the directory.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

VOCAB = 512
PROFILES = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 4, "head_dim": 16},
    "mlp": {"hidden_size": 512, "intermediate_size": 4096, "num_hidden_layers": 8, "num_attention_heads": 4,
            "num_key_value_heads": 4, "head_dim": 64},
}
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

# What the BPE learns its merges from: enough English-like text that prompts tokenize to a few bytes a token.
_CORPUS = """The agent reads the task, calls a tool, waits for the observation and answers.
A session is a long multi-turn program; between turns the tool runs for seconds or minutes.
The engine keeps the session's prefix in its radix cache, so the next turn's prefill is short.
When the KV pool fills, the scheduler evicts, retracts and recomputes; requests wait in the queue.
Hello, world. Search the web for the weather in Paris and summarise it in one sentence.
def add(a, b): return a + b  # a python function with a docstring and a test
{"tool": "search", "query": "sglang radix cache", "results": [1, 2, 3]}
0123456789 the quick brown fox jumps over the lazy dog THE QUICK BROWN FOX
"""


def config(profile: str) -> dict:
    """The LlamaForCausalLM config.json for ``profile`` (keys as transformers' LlamaConfig names them)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **PROFILES[profile],
            "hidden_act": "silu", "max_position_embeddings": 16384, "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0, "vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False, "mlp_bias": False}


def build_tokenizer(out: Path) -> None:
    """Train the byte-level BPE (exactly VOCAB ids) and save it with its chat template into ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    # The trainer stops early when the text has no more pairs to merge: pad with unused ids so the
    # model's vocab (every id it may sample) and the tokenizer's agree.
    n = tok.get_vocab_size()
    if n < VOCAB:
        tok.add_tokens([f"<extra_{i}>" for i in range(VOCAB - n)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="tiny")
    args = ap.parse_args(argv)
    out: Path = args.dir
    out.mkdir(parents=True, exist_ok=True)
    want = json.dumps(config(args.profile), indent=2, sort_keys=True)
    cfg = out / "config.json"
    if not (cfg.exists() and cfg.read_text() == want and (out / "tokenizer.json").exists()):
        build_tokenizer(out)
        cfg.write_text(want)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
