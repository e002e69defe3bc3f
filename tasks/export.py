"""Export stage: the trained run as a HuggingFace GPT-2 folder, and what the model writes.

Copies the tokenizer into ``<run_dir>/tokenizer/`` (so the run folder stands alone), writes
``<run_dir>/hf/`` with gpt.export, and generates a few samples from it: greedy, and sampled with a
fixed seed, for each prompt. Cached on the checkpoint it exported and the tokenizer files.
"""
from __future__ import annotations

import time
from pathlib import Path

from prefect import task
from pydantic import BaseModel, ConfigDict

from gpt.checkpoint import Checkpointer
from gpt.files import write_atomic
from gpt.tokenizer import Tokenizer
from tasks.common.cache import StageCache
from tasks.common.digest import Digest

PROMPTS = ("The ", "It was the best of times", "To be, or not to be")
SAMPLE_TOKENS = 48
SAMPLE_SEED = 1234
# Generating on the machine that runs the flow: past this size, samples would take minutes there.
MAX_SAMPLE_PARAMS = 2_000_000_000


class ExportManifest(BaseModel):
    model_config = ConfigDict(frozen=True)

    path: str
    checkpoint: str
    samples: list[dict[str, str]]     # prompt, mode ("greedy" or "sampled, seed N"), text
    seconds: float

    def intact(self) -> bool:
        """The export's weights are still there."""
        from gpt.export import weight_files

        try:
            return bool(weight_files(self.path))
        except (OSError, ValueError, KeyError):
            return False


def export_run(run_dir: str, tokenizer: Tokenizer, prompts: tuple[str, ...] = PROMPTS) -> ExportManifest:
    from gpt.export import export
    from gpt.generate import complete, load
    from gpt.model import param_count

    started = time.perf_counter()
    run = Path(run_dir)
    tokenizer_dir = run / "tokenizer"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    for src, name in tokenizer.named_files():
        write_atomic(tokenizer_dir / name, Path(src).read_bytes())
    out = export(run, run / "hf")
    model, tokenizer = load(out)
    samples = []
    if param_count(model.config) <= MAX_SAMPLE_PARAMS:
        for prompt in prompts:
            for mode, options in (("greedy", {"greedy": True}),
                                  (f"sampled, seed {SAMPLE_SEED}", {"temperature": 0.8, "top_k": 50, "seed": SAMPLE_SEED})):
                text = "".join(complete(model, tokenizer, prompt, SAMPLE_TOKENS, **options))
                samples.append({"prompt": prompt, "mode": mode, "text": prompt + text})
    checkpoint = Checkpointer(run / "checkpoints", 1, 0).latest()
    return ExportManifest(path=str(out), checkpoint=str(checkpoint), samples=samples,
                          seconds=round(time.perf_counter() - started, 3))


def _export_cache_key(parameters: dict) -> str | None:
    """The newest checkpoint (its name and marker time) and the tokenizer files' contents."""
    run = Path(parameters["run_dir"])
    checkpoint = Checkpointer(run / "checkpoints", 1, 0).latest()
    if checkpoint is None:
        return None
    key = Digest(str(checkpoint), (checkpoint / "COMPLETE").stat().st_mtime_ns)
    for f in parameters["tokenizer"].files:
        key.add_file(f)
    return "export-" + key.hex(32)


export_task = task(export_run, name="export", cache_policy=StageCache(key_of=_export_cache_key), persist_result=True)
