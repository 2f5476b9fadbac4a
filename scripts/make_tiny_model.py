"""Make a tiny random Llama (2 layers, head_dim 32) and a WordLevel tokenizer, offline, for end-to-end tests.

Nothing comes from a model hub: the weights are random (seeded), the tokenizer's vocabulary is "w0".."wN".
vLLM's CPU attention backend accepts head_dim 32. Usage: python scripts/make_tiny_model.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB = 512


def make(out: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(VOCAB - len(specials))])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    gen = out / "generation_config.json"
    if gen.exists():
        cfg = json.loads(gen.read_text())
        cfg.pop("eos_token_id", None)  # let max_tokens decide where a test's generation ends
        gen.write_text(json.dumps(cfg))
    return out


if __name__ == "__main__":
    print(make(Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama")))
