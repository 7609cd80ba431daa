"""Write a tiny random Qwen3 model (config, safetensors, byte-level tokenizer) that vLLM can load
without any download; one engine step takes a few milliseconds on two CPU cores.

Run with the vLLM venv's Python (needs torch, safetensors, tokenizers): ``python tiny_model.py DIR``;
``bear.vllm_instance.launch.make_tiny_model`` does that.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# A ChatML-style template (BEAR's own), so that chat requests render with role markers and a
# default system turn as real chat models' templates do: exact token counts are tested against it.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }))  # fmt: skip
    return tok.get_vocab_size()


def write_model(out: Path, *, hidden: int = 64, layers: int = 2, heads: int = 2, kv_heads: int = 1,
                head_dim: int = 32, ffn: int = 128, max_len: int = 4096) -> None:  # fmt: skip
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    n_vocab = write_tokenizer(out)
    vocab = 320  # ≥ the tokenizer's 259 ids, padded
    assert n_vocab <= vocab
    eos = 256
    cfg = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "max_position_embeddings": max_len, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
        "bos_token_id": eos, "eos_token_id": eos,
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": eos, "eos_token_id": eos}))
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(vocab, hidden),
                                  "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}  # fmt: skip
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        t[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        t[p + "self_attn.q_proj.weight"] = rnd(heads * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = rnd(kv_heads * head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = rnd(kv_heads * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = rnd(hidden, heads * head_dim)
        t[p + "self_attn.q_norm.weight"] = torch.ones(head_dim, dtype=torch.bfloat16)
        t[p + "self_attn.k_norm.weight"] = torch.ones(head_dim, dtype=torch.bfloat16)
        t[p + "mlp.gate_proj.weight"] = rnd(ffn, hidden)
        t[p + "mlp.up_proj.weight"] = rnd(ffn, hidden)
        t[p + "mlp.down_proj.weight"] = rnd(hidden, ffn)
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    write_model(Path(sys.argv[1]))
