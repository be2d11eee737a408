"""Prove at real scale that emulated N devices equal real gloo DDP with N ranks, and that
gradient accumulation on one device equals the emulation of more devices.

Every run goes through the real CLI (``scripts/train.py``) on the default configuration
(MNIST, resnet8 width 16, global batch 64, SGD + cosine) for ``--steps`` optimizer steps with
``logger=none trainer.log_every=1 trainer.threads=1 trainer.eval_images=500``. Each pair of
runs is compared on the training loss at every step and on every tensor of
``checkpoints/last.pt`` (the model's parameters and buffers, the optimizer's momentum
buffers): the worst relative difference, normwise per tensor (max |a - b| / max |b|).

Section ``ddp``:

- ``trainer.precision=fp64``: emulated N=2 and N=4 against DDP N=2 and N=4 for bn and sync,
  and emulated sync N=1 against N=8. Each must be within 1e-9 (``--tolerance``).
- ``trainer.precision=fp32``: the same pairs, beside the noise floor of float32 training,
  which is chaotic here: the same emulated N=2 run with 1 and 2 threads (bn and sync; the
  larger of the two, for the loss and for last.pt separately). Each fp32 pair must stay
  within ``--margin`` times that floor.

Section ``accumulate`` (float64, bn): one device with ``trainer.accumulate=4`` against
emulated N=4, within 1e-9 in the loss and in every parameter and momentum buffer; the BN
buffers, the one difference, are left out and their differences reported. With
``bn.momentum=null`` (cumulative averages) the running statistics are compared too, against
the emulation's mean of every device's own (``parallel.dist_bn=reduce
parallel.broadcast_buffers=false``).

Writes ``reports/exactness/results.json`` (the figures and, per section, the command, the
commit, torch and the machine) and ``reports/exactness/README.md``, checked by
``tests/parallel/test_exactness_report.py``; prints a table. Exit status 1 when a pair misses
its bound.

    python scripts/prove_exactness.py                        # about 12 minutes on 2 cores
    python scripts/prove_exactness.py --jobs 1               # one run at a time
    python scripts/prove_exactness.py --section accumulate   # rerun one section (3 minutes),
                                                             # keep the other's figures
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from syncbn_lab.provenance import provenance
from syncbn_lab.run_compare import checkpoint_tensors, run_difference, train_cli

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "reports" / "exactness"
TRAIN = ROOT / "scripts" / "train.py"
TOLERANCE = 1e-9  # fp64 pairs: worst relative difference allowed
MARGIN = 3.0  # fp32 pairs: allowed multiple of the float32 noise floor (chaos varies)
SECTIONS = ("ddp", "accumulate")
ACCUMULATE = 4  # micro-batches on one device, against as many emulated devices
BN_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def emulated(bn: str, devices: int, threads: int = 1) -> tuple[str, ...]:
    return (
        f"bn={bn}",
        "parallel=emulated",
        f"parallel.devices={devices}",
        f"trainer.threads={threads}",
    )


def ddp(bn: str, devices: int) -> tuple[str, ...]:
    return (f"bn={bn}", "parallel=ddp", f"parallel.devices={devices}", "trainer.threads=1")


def accumulating(bn: str, accumulate: int) -> tuple[str, ...]:
    return (f"bn={bn}", "parallel=single", f"trainer.accumulate={accumulate}", "trainer.threads=1")


def pairs() -> list[dict]:
    """What is compared: name, section, kind (exact | floor | fp32), the two runs' overrides,
    and the endings of the checkpoint tensors left out of the comparison."""
    return [{"section": "ddp", **pair} for pair in ddp_pairs()] + [
        {"section": "accumulate", **pair} for pair in accumulate_pairs()
    ]


def accumulate_pairs() -> list[dict]:
    """One device accumulating K micro-batches against K emulated devices, in float64."""
    k, cumulative = ACCUMULATE, ("bn.momentum=null",)
    each_device_own = ("parallel.dist_bn=reduce", "parallel.broadcast_buffers=false")
    return [
        {
            "name": f"fp64 bn: single accumulate={k} vs emulated N={k}",
            "precision": "fp64",
            "kind": "exact",
            "a": accumulating("bn", k),
            "b": emulated("bn", k),
            "leave_out": BN_BUFFERS,
        },
        {
            "name": f"fp64 bn, momentum=null: single accumulate={k} vs emulated N={k}, "
            "the mean of every device's statistics",
            "precision": "fp64",
            "kind": "exact",
            "a": accumulating("bn", k) + cumulative,
            "b": emulated("bn", k) + cumulative + each_device_own,
            "leave_out": BN_BUFFERS[2:],
        },
    ]


def ddp_pairs() -> list[dict]:
    """Emulated N devices against N gloo DDP ranks, in float64 and float32."""
    out = []
    for precision in ("fp64", "fp32"):
        kind = "exact" if precision == "fp64" else "fp32"
        for devices in (2, 4):
            for bn in ("bn", "sync"):
                out.append(
                    {
                        "name": f"{precision} {bn}: emulated N={devices} vs ddp N={devices}",
                        "precision": precision,
                        "kind": kind,
                        "a": emulated(bn, devices),
                        "b": ddp(bn, devices),
                    }
                )
        out.append(
            {
                "name": f"{precision} sync: emulated N=1 vs emulated N=8",
                "precision": precision,
                "kind": kind,
                "a": emulated("sync", 1),
                "b": emulated("sync", 8),
            }
        )
    for bn in ("bn", "sync"):
        out.append(
            {
                "name": f"fp32 {bn}: emulated N=2, 1 vs 2 threads (noise floor)",
                "precision": "fp32",
                "kind": "floor",
                "a": emulated(bn, 2, threads=1),
                "b": emulated(bn, 2, threads=2),
            }
        )
    return out


def base(steps: int, precision: str) -> tuple[str, ...]:
    return (
        f"data.root={ROOT / 'data'}",  # the repository's data/ wherever this is started
        "logger=none",
        f"trainer.max_steps={steps}",
        "trainer.log_every=1",
        "trainer.eval_images=500",  # the comparison is of training; keep evaluation short
        f"trainer.precision={precision}",
    )


def measure(steps: int, jobs: int, workdir: Path, sections: list[str]) -> list[dict]:
    """Run every distinct configuration of ``sections``' pairs once, then compare the pairs."""
    todo = [pair for pair in pairs() if pair["section"] in sections]
    runs = {}
    for pair in todo:
        for side in ("a", "b"):
            overrides = base(steps, pair["precision"]) + pair[side]
            runs.setdefault(overrides, workdir / f"run{len(runs):02d}")

    def one(item):
        overrides, run_dir = item
        train_cli(TRAIN, list(overrides), run_dir)
        print(f"  done: {' '.join(overrides[2:])}", flush=True)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(one, runs.items()))
    results = []
    for pair in todo:
        a = runs[base(steps, pair["precision"]) + pair["a"]]
        b = runs[base(steps, pair["precision"]) + pair["b"]]
        leave_out = pair.get("leave_out", ())
        diff = run_difference(a, b, leave_out)
        if "num_batches_tracked" in leave_out:  # the counters: how many updates, not how far
            diff["num_batches_tracked"] = [counter(a), counter(b)]
        results.append(
            {
                "name": pair["name"],
                "section": pair["section"],
                "precision": pair["precision"],
                "kind": pair["kind"],
                "a": list(pair["a"]),
                "b": list(pair["b"]),
                **diff,
            }
        )
    return results


def counter(run_dir: Path) -> int:
    """The BN layers' num_batches_tracked in checkpoints/last.pt (the same in every layer)."""
    counts = {
        int(v) for k, v in checkpoint_tensors(run_dir).items() if k.endswith("num_batches_tracked")
    }
    if len(counts) != 1:
        raise AssertionError(f"{run_dir}: num_batches_tracked differs between layers: {counts}")
    return counts.pop()


METRICS = ("loss", "checkpoint")


def judge(results: list[dict], tolerance: float, margin: float) -> tuple[dict, list[str]]:
    """The fp32 noise floor of each metric (loss, checkpoint) and the pairs that miss their
    bound; every fp32 pair gets ``floor_ratio``, its worst multiple of the floor."""
    floors = [r for r in results if r["kind"] == "floor"]
    floor = {m: max(r[m] for r in floors) for m in METRICS}
    missed = []
    for r in results:
        if r["kind"] == "exact":
            r["bound"] = tolerance
            ok = r["worst"] <= tolerance
        elif r["kind"] == "fp32":
            r["floor_ratio"] = max(r[m] / floor[m] for m in METRICS)
            r["bound"] = margin
            ok = r["floor_ratio"] <= margin
        else:
            r["bound"], ok = None, True
        if not ok:
            missed.append(r["name"])
    return floor, missed


def table(results: list[dict]) -> str:
    left_out = any("left_out" in r for r in results)
    rows = [
        "| pair | worst, loss (step) | worst, last.pt (tensor) | bound |"
        + (" left out of last.pt |" if left_out else ""),
        "|---|---|---|---|" + ("---|" if left_out else ""),
    ]
    for r in results:
        if r["kind"] == "exact":
            bound = f"{r['bound']:.0e}"
        elif r["kind"] == "fp32":
            bound = f"{r['floor_ratio']:.2f}x floor (<= {r['bound']:g}x)"
        else:
            bound = "the floor"
        row = (
            f"| {r['name']} | {r['loss']:.2e} ({r['loss_step']}) | "
            f"{r['checkpoint']:.2e} ({r['checkpoint_tensor']}) | {bound} |"
        )
        if left_out:
            row += f" {left_out_text(r)} |"
        rows.append(row)
    return "\n".join(rows)


def left_out_text(r: dict) -> str:
    """The tensors a pair leaves out and how far apart they are (counters: both values)."""
    parts = []
    for ending, diff in r.get("left_out", {}).items():
        if ending == "num_batches_tracked":
            a, b = r["num_batches_tracked"]
            parts.append(f"{ending} {a} vs {b}")
        else:
            parts.append(f"{ending} {diff:.2e}")
    return ", ".join(parts)


def ran(section: dict) -> str:
    meta = section["meta"]
    return (
        f"Ran as `{section['command']}` at commit `{meta['git_commit']}`, torch {meta['torch']}, "
        f"{meta['machine']['cpu']}, {meta['machine']['cores']} cores."
    )


def readme(report: dict) -> str:
    by_section = {name: [r for r in report["results"] if r["section"] == name] for name in SECTIONS}
    return f"""# Exactness at real scale: emulated devices, real DDP, gradient accumulation

Generated by `python scripts/prove_exactness.py` (`--section NAME` reruns one section and
keeps the other's figures; each section names the command and commit it ran with); checked by
`tests/parallel/test_exactness_report.py`. `results.json` holds every figure, including the
relative difference of the loss at each step.

Every run is `scripts/train.py` on the default configuration (MNIST, resnet8 width 16, global
batch 64, SGD with Nesterov momentum, cosine schedule) for {report["steps"]} optimizer steps,
`logger=none trainer.log_every=1 trainer.threads=1 trainer.eval_images=500` (evaluation is
not compared). A pair is compared on the training loss at every step (relative difference)
and on the tensors of `checkpoints/last.pt` (parameters, BatchNorm buffers, SGD momentum
buffers); a tensor's difference is max |a - b| / max |b|.

{ddp_section(report, by_section["ddp"])}

{accumulate_section(report, by_section["accumulate"])}
"""


def ddp_section(report: dict, results: list[dict]) -> str:
    exact = [r for r in results if r["kind"] == "exact"]
    fp32 = [r for r in results if r["kind"] == "fp32"]
    worst = max(exact, key=lambda r: r["worst"])
    worst_loss = max(exact, key=lambda r: r["loss"])
    worst32 = max(fp32, key=lambda r: r["floor_ratio"])
    floor = report["fp32_noise_floor"]
    exact_verdict = "within" if worst["worst"] <= report["tolerance"] else "NOT within"
    fp32_verdict = "within" if worst32["floor_ratio"] <= report["margin"] else "NOT within"
    return f"""## Emulated N devices against real DDP

{ran(report["sections"]["ddp"])} Every pair is compared on all {worst["tensors"]} tensors of
`last.pt`.

- **float64** (`trainer.precision=fp64`): the worst difference over all pairs is
  **{worst["worst"]:.1e}** ({worst["name"]}, {worst["checkpoint_tensor"]}), {exact_verdict}
  the {report["tolerance"]:.0e} required; the worst loss difference is
  {worst_loss["loss"]:.1e} ({worst_loss["name"]}). What is left is the rounding of sums
  taken in another order (gloo's all_reduce against the emulation's sum over the device
  axis, one batch of 64 against two of 32).
- **float32**: training is chaotic, so a difference in summation order grows step by step.
  The noise floor, the same emulated N=2 run with 1 and 2 threads, is
  **{floor["loss"]:.1e}** in the loss and {floor["checkpoint"]:.1e} in `last.pt` (the SGD
  momentum buffers, which hold the latest gradients, move most). DDP against emulation, and
  N=1 against N=8, differ by as much and no more: at most {worst32["floor_ratio"]:.2f}x the
  floor ({worst32["name"]}), {fp32_verdict} the {report["margin"]:g}x allowed. In float32 no test
  on this configuration can tell a semantic difference from summation order; in float64 the
  same pairs agree to {worst["worst"]:.0e}.

{table(results)}"""


def accumulate_section(report: dict, results: list[dict]) -> str:
    trains, averages = results  # accumulate_pairs' order
    k, tolerance = ACCUMULATE, report["tolerance"]
    worst = max(r["worst"] for r in results)
    verdict = "within" if worst <= tolerance else "NOT within"
    stats = max(trains["left_out"][b] for b in BN_BUFFERS[:2])
    ours, theirs = trains["num_batches_tracked"]
    return f"""## Gradient accumulation against more devices

{ran(report["sections"]["accumulate"])}

One device accumulating {k} micro-batches (`parallel=single trainer.accumulate={k} bn=bn`)
against the emulation of {k} devices (`parallel=emulated parallel.devices={k} bn=bn`), in
float64: micro-batch k holds the {64 // k} images of device k's slice, so per-device
BatchNorm normalises the same images together in both. The loss at every step and all
{trains["tensors"]} tensors of parameters and SGD momentum buffers agree to
**{trains["worst"]:.1e}**, {verdict} the {tolerance:.0e} required. The one difference is
the BatchNorm buffers, left out of that comparison: `running_mean` and `running_var`
differ by up to {stats:.1e} and `num_batches_tracked` is {ours} against {theirs}.
Accumulation updates the running statistics once per micro-batch, from every device's slice
in turn, {k} times a step; the emulation, as DDP, keeps device 0's, updated once a step from
its slice. With
`bn.momentum=null` (cumulative averages, in which every update weighs alike) accumulation's
running statistics are therefore the mean over the {k} devices of each device's own, which
the emulation computes with `parallel.dist_bn=reduce parallel.broadcast_buffers=false`: the
two agree to {averages["worst"]:.1e} in all {averages["tensors"]} tensors but the counters.

{table(results)}"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    parser.add_argument("--out", type=Path, default=OUT, help="folder for results.json, README.md")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="fp64 bound")
    parser.add_argument("--margin", type=float, default=MARGIN, help="fp32 bound / noise floor")
    parser.add_argument(
        "--section",
        action="append",
        choices=SECTIONS,
        help="run only this section (repeatable); the others' figures are kept from --out",
    )
    args = parser.parse_args(argv)
    sections = args.section or list(SECTIONS)
    kept = kept_sections(args.out, args.steps, [s for s in SECTIONS if s not in sections])
    meta = provenance()
    with tempfile.TemporaryDirectory(prefix="prove-exactness-") as tmp:
        measured = measure(args.steps, args.jobs, Path(tmp), sections)
    command = " ".join(["python scripts/prove_exactness.py", *(argv or sys.argv[1:])])
    ran_with = {name: {"command": command, "meta": meta} for name in sections}
    order = [pair["name"] for pair in pairs()]
    results = sorted(kept["results"] + measured, key=lambda r: order.index(r["name"]))
    floor, missed = judge(results, args.tolerance, args.margin)
    report = {
        "sections": {name: {**kept["sections"], **ran_with}[name] for name in SECTIONS},
        "steps": args.steps,
        "tolerance": args.tolerance,
        "margin": args.margin,
        "fp32_noise_floor": floor,
        "results": results,
        "missed": missed,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "README.md").write_text(readme(report))
    print(table(results))
    print(
        f"fp32 noise floor: loss {floor['loss']:.2e}, last.pt {floor['checkpoint']:.2e}; "
        f"wrote {args.out / 'results.json'}"
    )
    for name in missed:
        print(f"MISSED: {name}", file=sys.stderr)
    return 1 if missed else 0


def kept_sections(out: Path, steps: int, names: list[str]) -> dict:
    """The results and provenance of the sections ``names`` from ``out/results.json``, which
    must hold every pair of them, run for ``steps`` steps (SystemExit otherwise)."""
    if not names:
        return {"sections": {}, "results": []}
    path = out / "results.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    wanted = {pair["name"] for pair in pairs() if pair["section"] in names}
    results = [r for r in previous.get("results", []) if r.get("section") in names]
    if previous.get("steps") != steps or {r["name"] for r in results} != wanted:
        raise SystemExit(
            f"error: {path} does not hold section(s) {', '.join(names)} run for {steps} "
            "steps; run them too (drop --section)"
        )
    return {"sections": {n: previous["sections"][n] for n in names}, "results": results}


if __name__ == "__main__":
    sys.exit(main())
