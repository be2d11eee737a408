"""Run by tests/train/test_bitwise_refactor.py with PYTHONPATH at one source tree: a short
run per parallel mode in float32 and float64, printed as JSON (every logged training loss,
the test loss and a sha256 of the final parameters and buffers)."""

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch

from syncbn_lab.config import compose
from syncbn_lab.train import run

TINY = [
    "data=synthetic", "data.num_train=256", "data.num_val=64", "data.num_test=64",
    "model.width=4", "logger=none", "trainer.global_batch_size=32", "trainer.log_every=1",
    "trainer.max_steps=5", "trainer.threads=1", "trainer.preflight=false",
]  # fmt: skip
CASES = {
    "single": ["parallel=single", "bn=bn"],
    "emulated_bn": ["parallel=emulated", "parallel.devices=4", "bn=bn"],
    "emulated_sync": ["parallel=emulated", "parallel.devices=4", "bn=sync"],
    "ddp_sync": ["parallel=ddp", "parallel.devices=2", "bn=sync"],
}


def fingerprint(run_dir: Path, summary: dict) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode() + state[key].cpu().contiguous().numpy().tobytes())
    return {
        "losses": [r.get("train/loss") for r in rows],
        "test_loss": summary["test_loss"],
        "params": digest.hexdigest(),
    }


def main() -> None:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in CASES.items():
            for precision in ("fp32", "fp64"):
                cfg = compose([*TINY, *overrides, f"trainer.precision={precision}"])
                run_dir = Path(tmp) / f"{name}_{precision}"
                out[f"{name}_{precision}"] = fingerprint(run_dir, run(cfg, run_dir))
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
