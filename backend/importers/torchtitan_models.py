"""torchtitan's model names and flavors -> ModelSpec fields (no torchtitan code is imported or run).

The flavor tables are torchtitan's own `TransformerModelArgs` (torchtitan/models/llama3/__init__.py at v0.1.0,
June 2025; llama2 flavors of torchtitan/models/llama/__init__.py, autumn 2024), and the MLP width is torchtitan's
FeedForward rule: hidden = int(2 * 4 * dim / 3), times ffn_dim_multiplier when set, rounded up to multiple_of.
The vocabulary is the tokenizer's (`tokenizer.n_words`): Meta's Llama 3 tiktoken tokenizer has 128,256 tokens,
Llama 2's sentencepiece tokenizer 32,000; a config.json given beside the TOML replaces the flavor altogether.
"""

from __future__ import annotations

from typing import Any

from backend.importers.import_result import ConfigImportError

_LLAMA = dict(norm="rmsnorm", mlp="swiglu", positions="rope", tie_embeddings=False, bias="none", attention="flash")
# name -> (vocab size of its tokenizer, {flavor: (dim, n_layers, n_heads, n_kv_heads, ffn_dim_multiplier, multiple_of)})
FLAVORS: dict[str, tuple[int, dict[str, tuple[int, int, int, int | None, float | None, int]]]] = {
    "llama3": (128256, {
        "8B": (4096, 32, 32, 8, 1.3, 1024),
        "70B": (8192, 80, 64, 8, 1.3, 4096),
        "405B": (16384, 126, 128, 8, 1.2, 4096),
    }),
    "llama2": (32000, {
        "7B": (4096, 32, 32, None, None, 256),
        "13B": (5120, 40, 40, None, None, 256),
        "70B": (8192, 80, 64, 8, 1.3, 4096),
    }),
}
FLAVORS["llama"] = FLAVORS["llama2"]  # autumn-2024 torchtitan named its Llama 2 model "llama2"; older "llama"
PRESETS = {("llama3", "8B"): "llama-3-8b", ("llama3", "70B"): "llama-3-70b", ("llama3", "405B"): "llama-3.1-405b",
           ("llama2", "7B"): "llama-2-7b", ("llama2", "13B"): "llama-2-13b", ("llama2", "70B"): "llama-2-70b",
           ("llama", "7B"): "llama-2-7b", ("llama", "13B"): "llama-2-13b", ("llama", "70B"): "llama-2-70b"}
"""The ShardLab preset of each flavor (tests/unit/test_import_config.py holds their shapes equal)."""


def ffn_hidden(dim: int, ffn_dim_multiplier: float | None, multiple_of: int) -> int:
    """torchtitan FeedForward: hidden_dim = 4 * dim, then int(2 * hidden / 3), * multiplier, rounded up."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def flavor_model(name: str, flavor: str, seq_len: int) -> tuple[dict[str, Any], list[str]]:
    """(ModelSpec fields, notes) of a torchtitan model name and flavor; ConfigImportError for one not in the table."""
    if name not in FLAVORS or flavor not in FLAVORS[name][1]:
        known = "; ".join(f"{n}: {', '.join(f)}" for n, (_, f) in FLAVORS.items() if n != "llama")
        raise ConfigImportError([f"model.name={name!r} flavor={flavor!r} is not a torchtitan flavor ShardLab knows "
                                 f"({known}): give the model's config.json with --model-config"])
    vocab, table = FLAVORS[name]
    dim, layers, heads, kv, mult, multiple_of = table[flavor]
    model = dict(_LLAMA, vocab_size=vocab, d_model=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv,
                 ffn_hidden=ffn_hidden(dim, mult, multiple_of), seq_len=seq_len, norm_eps=1e-5,
                 source={"torchtitan": {"name": name, "flavor": flavor}})
    if (name, flavor) in PRESETS:
        model["source"]["preset"] = PRESETS[(name, flavor)]
    notes = [f"torchtitan {name} {flavor}"
             + (f" = ShardLab's preset {PRESETS[(name, flavor)]}" if (name, flavor) in PRESETS
                                              else "") + f": dim {dim}, {layers} layers, {heads} heads, "
             f"{kv or heads} kv heads, MLP {model['ffn_hidden']} (torchtitan's FeedForward rule), vocabulary {vocab:,} "
             f"(the {'Llama 3 tiktoken' if vocab == 128256 else 'Llama 2 sentencepiece'} tokenizer's n_words)"]
    return model, notes


def dumped_model(model: dict[str, Any], *, name: str, flavor: str, seq_len: int) -> tuple[dict[str, Any], list[str]]:
    """ModelSpec fields from a Trainer.Config dump's `model_spec.model` (the module configs of a Decoder: dim,
    vocab_size, layers[i].attention / feed_forward, lm_head). Every layer must have the same shape."""
    try:
        layers = model["layers"]
        first = layers[0]
        attn, ffn = first["attention"], first["feed_forward"]
        dim, vocab = int(model["dim"]), int(model["vocab_size"])
        heads, kv = int(attn["n_heads"]), attn.get("n_kv_heads")
        hidden = int(ffn["w1"]["out_features"])
    except (KeyError, IndexError, TypeError, ValueError) as e:
        if isinstance(model, dict) and model.get("layers") and "moe" in (model["layers"][0] or {}):
            raise ConfigImportError(["model_spec.model: mixture-of-experts decoders of the Trainer.Config dump are not "
                                     "mapped yet; give the model's config.json with --model-config"]) from None
        raise ConfigImportError([f"model_spec.model is not a decoder config ShardLab can read ({type(e).__name__}: "
                                 f"{e}); give the model's config.json with --model-config"]) from None
    shapes = {(layer.get("attention", {}).get("n_heads"),
               layer.get("feed_forward", {}).get("w1", {}).get("out_features"))
              for layer in layers if isinstance(layer, dict)}
    if len(shapes) != 1:
        raise ConfigImportError([f"model_spec.model.layers hold {len(shapes)} different layer shapes: ShardLab models "
                                 "a stack of identical blocks"])
    head_dim = attn.get("head_dim")
    if head_dim not in (None, dim // heads):
        raise ConfigImportError([f"model_spec.model.layers[0].attention.head_dim={head_dim} != dim / n_heads = "
                                 f"{dim} / {heads}: decoupled head sizes are not modelled"])
    tied = "lm_head" not in model or model["lm_head"] is None
    out = dict(_LLAMA, vocab_size=vocab, d_model=dim, n_layers=len(layers), n_heads=heads,
               n_kv_heads=None if kv in (None, heads) else int(kv), ffn_hidden=hidden, seq_len=seq_len,
               tie_embeddings=tied, source={"torchtitan": {"name": name, "flavor": flavor}})
    return out, [f"torchtitan {name} {flavor} from the dumped model config: dim {dim}, {len(layers)} layers, "
                 f"{heads} heads, MLP {hidden}, vocabulary {vocab:,}"]
