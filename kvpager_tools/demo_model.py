"""Tiny random-weight Llama-family checkpoints, built offline.

No weights can be downloaded on our machines, so the demo stack and the tests
build their own checkpoint: a ``transformers`` model with random weights
(deterministic for a seed) plus a byte-level BPE tokenizer trained on a small
built-in English corpus. The result is a plain HF checkpoint directory that
``AutoModelForCausalLM`` / ``AutoTokenizer`` load with ``local_files_only``.

``kvpager demo-model DIR`` builds one from the command line. This module stays
light at import: torch, transformers and tokenizers load inside the functions.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

ARCHS = ("llama", "qwen2", "mistral", "gemma2", "gemma3")
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|bos|>", "<|eos|>", "<|pad|>"
# A plain chat template, so chat clients work against the demo model (/v1/chat/completions):
#   <|bos|>system: ...\nuser: ...\nassistant:
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers saves and finds it
DEFAULT_VOCAB_SIZE = 512
DEFAULT_MAX_POSITIONS = 2048

# A small corpus so the tokenizer learns real English merges.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A memory manager hands out fixed
size blocks of cache to every sequence, just as an operating system pages the
memory of its processes. When a block fills, the next token goes into a fresh
block, and the block table of the sequence grows by one entry.
Once upon a time there was a little server that answered questions. Every
morning it woke up, loaded its weights, and waited for requests to arrive.
People asked about the weather, about history, about mathematics and music.
The server read each prompt, thought for a while, and wrote an answer one
token at a time. Some answers were short and some were long.
Attention lets every token look at the tokens before it. Keys and values of
past tokens are kept in a cache so that they are not computed again. Paged
attention stores that cache in blocks, which removes fragmentation and lets
many sequences share the blocks of a common prefix.
In the beginning of the year the village held a market. Farmers brought
apples, bread, cheese and honey. Children ran between the stalls while their
parents talked about the harvest, the rain and the price of wheat.
The scientist wrote the numbers in her notebook: one, two, three, four, five,
six, seven, eight, nine, ten. She checked the results twice before she was
sure that the experiment had worked and that the model was right.
What is the capital of France? The capital of France is Paris. What is the
largest planet? The largest planet in our solar system is Jupiter.
Hello, world! How are you today? I am fine, thank you. Let us write a story
about a dragon who learned to read books in a quiet library by the sea.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
"""


def _tokenizer(vocab_size: int, max_len: int):
    """Train a byte-level BPE on the built-in corpus; returns PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=max_len,
    )
    out.chat_template = CHAT_TEMPLATE
    return out


def _config(arch: str, sliding_window: int | None = None, max_window_layers: int | None = None, **kw):
    """sliding_window: Mistral's on every layer; Qwen2's on the layers from
    ``max_window_layers`` on; Gemma 2's on every other layer (its default
    4096 when None); Gemma 3's on two of every three (local RoPE there). Llama has none."""
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

    if arch == "llama":
        if sliding_window is not None:
            raise ValueError("llama has no sliding window")
        return LlamaConfig(**kw)
    if arch == "qwen2":  # qkv projections carry a bias
        if sliding_window is None:
            return Qwen2Config(use_sliding_window=False, **kw)
        return Qwen2Config(use_sliding_window=True, sliding_window=sliding_window,
                           max_window_layers=kw["num_hidden_layers"] // 2 if max_window_layers is None
                           else max_window_layers, **kw)
    if arch == "mistral":
        return MistralConfig(sliding_window=sliding_window, **kw)
    if arch == "gemma2":  # alternating local / global layers, soft-capped logits
        head_dim = kw["hidden_size"] // kw["num_attention_heads"]
        return Gemma2Config(head_dim=head_dim, query_pre_attn_scalar=head_dim,
                            sliding_window=sliding_window or 4096, **kw)
    if arch == "gemma3":
        head_dim = kw["hidden_size"] // kw["num_attention_heads"]
        layer_types = ["full_attention" if i % 3 == 2 else "sliding_attention" for i in range(kw["num_hidden_layers"])]
        return Gemma3TextConfig(head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=sliding_window or 4096,
                                layer_types=layer_types, **kw)
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def build_demo_model(
    out_dir: str | os.PathLike,
    *,
    arch: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    intermediate_size: int | None = None,
    model_vocab_size: int | None = None,
    max_position_embeddings: int = DEFAULT_MAX_POSITIONS,
    seed: int = 0,
    dtype: str = "float32",
    initializer_range: float = 0.1,
    sliding_window: int | None = None,
    max_window_layers: int | None = None,
) -> Path:
    """Write a random-weight checkpoint + tokenizer into ``out_dir``.

    Args:
        vocab_size: target tokenizer size; the model's vocabulary equals the
            trained tokenizer's length (a tiny corpus may yield fewer merges).
        model_vocab_size: pad the model's embedding to this many rows (>= the
            tokenizer's size), as real checkpoints often do; for benchmarks.
        initializer_range: std of the random weights. Larger than HF's 0.02 so
            that logits are spread out and greedy argmax has clear margins
            (exactness tests compare against ``generate``).
        sliding_window, max_window_layers: see ``_config``.
    Returns:
        the checkpoint directory. Deterministic for a given seed.
    """
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(vocab_size, max_position_embeddings)
    if intermediate_size is None:  # Llama's ~8/3 ratio, rounded to 16
        intermediate_size = max(16, (hidden_size * 8 // 3 + 15) // 16 * 16)
    if model_vocab_size is not None and model_vocab_size < len(tokenizer):
        raise ValueError(f"model_vocab_size {model_vocab_size} < tokenizer size {len(tokenizer)}")
    config = _config(
        arch,
        sliding_window=sliding_window,
        max_window_layers=max_window_layers,
        vocab_size=model_vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=initializer_range,
        tie_word_embeddings=False,
    )
    torch_dtype = getattr(torch, dtype)
    # fork_rng: building a model must not disturb the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(torch_dtype).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def default_demo_dir() -> Path:
    home = os.environ.get("KVPAGER_HOME")
    base = Path(home) if home else Path.home() / ".cache" / "kvpager"
    return base / "models" / "demo"


def ensure_demo_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """Build the default demo model once; later calls return the same directory."""
    out = Path(cache_dir) if cache_dir is not None else default_demo_dir()
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        if not (out / CHAT_TEMPLATE_FILE).exists():  # built before the demo had a chat template
            tmp = out / f"{CHAT_TEMPLATE_FILE}.tmp-{os.getpid()}"
            tmp.write_text(CHAT_TEMPLATE)
            tmp.rename(out / CHAT_TEMPLATE_FILE)
        return out
    # Build beside the target and rename, so a crash never leaves half a model.
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    build_demo_model(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(out)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def register(subparsers) -> None:
    p = subparsers.add_parser("demo-model", help="build a tiny random-weight checkpoint + tokenizer")
    p.add_argument("dir", nargs="?", default=None, help=f"output directory (default {default_demo_dir()})")
    p.add_argument("--arch", choices=ARCHS, default="llama")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p.add_argument("--max-position-embeddings", type=int, default=DEFAULT_MAX_POSITIONS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    p.add_argument("--sliding-window", type=int, default=None,
                   help="mistral: every layer; qwen2: the upper half; gemma2: every other layer")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    out = build_demo_model(
        args.dir or default_demo_dir(),
        arch=args.arch,
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_position_embeddings,
        seed=args.seed,
        dtype=args.dtype,
        sliding_window=args.sliding_window,
    )
    print(out)
    return 0
