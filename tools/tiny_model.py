"""A tiny randomly initialised GPT-2 with a locally trained tokenizer.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on a few
sentences below, the weights come from a fixed seed. sglang serves it on CPU
(``--device cpu``) without any workaround. The directory is cached and reused;
it is rebuilt only when the recipe (``RECIPE_VERSION`` or the config) changes.

    python tools/tiny_model.py [DIR]      # prints the model directory
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

RECIPE_VERSION = 1
SEED = 1234
CONFIG = dict(
    vocab_size=512,
    n_embd=64,
    n_layer=2,
    n_head=4,
    n_inner=128,
    n_positions=512,
    initializer_range=0.3,
)
SPECIAL = "<|endoftext|>"
CORPUS = [
    "The decode scheduler thread never waits on the network.",
    "A prefill server that hangs must not stall a decode step.",
    "Every request ends within its retry budget: admitted or aborted.",
    "The quick brown fox jumps over the lazy dog.",
    "Prefill computes the prompt, decode generates the tokens one by one.",
    "The router sends each request to one prefill and one decode server.",
    "Key and value caches move from prefill to decode over the network.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ; : ! ? ( ) ' \"",
]


def default_cache_dir() -> Path:
    base = os.environ.get("SGLANG_PD_PATCH_CACHE") or Path.home() / ".cache" / (
        "sglang-pd-patch"
    )
    return Path(base).expanduser() / "tiny-models"


def recipe_key() -> str:
    blob = json.dumps(
        {"v": RECIPE_VERSION, "seed": SEED, "config": CONFIG, "corpus": CORPUS},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=CONFIG["vocab_size"],
        special_tokens=[SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    assert tok.get_vocab_size() <= CONFIG["vocab_size"], tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL,
        eos_token=SPECIAL,
        unk_token=SPECIAL,
        pad_token=SPECIAL,
    )
    fast.model_max_length = CONFIG["n_positions"]
    fast.save_pretrained(out)
    return fast


def _build(out: Path) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    fast = _build_tokenizer(out)
    eos = fast.convert_tokens_to_ids(SPECIAL)
    torch.manual_seed(SEED)
    config = GPT2Config(**CONFIG, bos_token_id=eos, eos_token_id=eos)
    model = GPT2LMHeadModel(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    (out / "tiny_model_recipe.json").write_text(
        json.dumps({"key": recipe_key(), "config": CONFIG, "seed": SEED}, indent=1)
    )


def ensure_tiny_gpt2(cache_dir: Path | str | None = None) -> Path:
    """Return the directory of the tiny GPT-2, building it once if needed."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    target = root / f"gpt2-tiny-{recipe_key()}"
    if (target / "tiny_model_recipe.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        _build(tmp)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished first; its copy is equivalent.
            if not (target / "tiny_model_recipe.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


if __name__ == "__main__":
    print(ensure_tiny_gpt2(sys.argv[1] if len(sys.argv) > 1 else None))
