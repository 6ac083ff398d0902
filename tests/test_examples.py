"""The examples train for real (a tiny model for a few steps, on one process and on two: DDP over
gloo started by `trainforge launch`), and the benchmarks run end to end. `trainforge launch` runs as
a real subprocess; the other runs are `python script ...` forked from the test's rank server
(tests/helpers/forklaunch.py): neither a launcher nor a fresh interpreter is what they test."""

import csv
import re
import sys
from pathlib import Path

import pytest

from tests.helpers import forklaunch, procs

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "char_gpt.py"
# A model small enough for a few seconds of CPU: one block, width 32, 16 windows of 64 characters.
TINY = [
    "--max-steps",
    "30",
    "--eval-every",
    "10",
    "--n-layer",
    "1",
    "--n-embd",
    "32",
    "--batch-size",
    "16",
    "--tracker",
    "csv",
    "--sample-chars",
    "40",
    "--log-every",
    "10",
]


def run(args, cwd, timeout):
    """Run a command in its own process group; the whole group is killed on timeout."""
    env = procs.test_env(XDG_CONFIG_HOME=str(cwd / "xdg"))  # no user launch config
    return procs.run([sys.executable, *map(str, args)], cwd=cwd, env=env, timeout=timeout).stdout


def run_script(script, *args, cwd, timeout):
    """`python script args...` forked from the rank server, output merged; fails unless it exits 0."""
    env = procs.test_env(XDG_CONFIG_HOME=str(cwd / "xdg"))  # no user launch config
    return forklaunch.run_script(script, *args, cwd=cwd, env=env, timeout=timeout).stdout


def losses(output):
    initial = re.search(r"initial val loss ([0-9.]+)", output)
    final = re.search(r"final val loss ([0-9.]+) at step (\d+)", output)
    assert initial and final, output
    return float(initial.group(1)), float(final.group(1)), int(final.group(2))


def check_run(root, output, world_size):
    initial, final, step = losses(output)
    assert step == 30
    # Untrained, the model is close to a uniform guess over the vocabulary; 30 steps must beat it clearly.
    uniform = float(re.search(r"ln\(vocab\) = ([0-9.]+)", output).group(1))
    assert abs(initial - uniform) < 0.5, output
    assert final < initial - 0.5, output
    assert f"{world_size} process(es)" in output
    assert "char_gpt: sample:\ndef " in output  # the generated text continues the prompt
    run_dir = root / "lightning_logs" / "version_0"  # the CSV tracker's version folder (Lightning's layout)
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest").is_file()
    final_ckpt = checkpoints / "epoch=0-step=30"
    assert (final_ckpt / "model.safetensors").is_file()
    assert {p.name for p in final_ckpt.glob("rng_rank*.pt")} == {f"rng_rank{r}.pt" for r in range(world_size)}
    with open(run_dir / "metrics.csv") as f:
        val = [float(row["val/loss"]) for row in csv.DictReader(f) if row.get("val/loss")]
    assert len(val) == 3 and val[-1] == pytest.approx(final, abs=1e-4)  # steps 10, 20, 30, as printed


def test_char_gpt_one_process(tmp_path):
    out = run_script(EXAMPLE, *TINY, "--root-dir", tmp_path / "run", cwd=tmp_path, timeout=120)
    check_run(tmp_path / "run", out, world_size=1)


@pytest.mark.slow
def test_char_gpt_two_processes_through_trainforge_launch(tmp_path):
    out = run(
        ["-m", "trainforge", "launch", "--nproc-per-node", "2", EXAMPLE, *TINY, "--root-dir", tmp_path / "run"],
        tmp_path,
        timeout=180,
    )
    check_run(tmp_path / "run", out, world_size=2)


CONVERTED = ROOT / "examples" / "raw_loop_to_accelerator.py"
CONVERTED_TINY = ["--steps", "40", "--n-layer", "1", "--n-embd", "32", "--batch-size", "16"]


def check_converted(output, state, world_size):
    found = re.search(r"(\d) process\(es\), val loss ([0-9.]+) -> ([0-9.]+) after (\d+) steps", output)
    assert found, output
    assert int(found.group(1)) == world_size and int(found.group(4)) == 40
    assert float(found.group(3)) < float(found.group(2)) - 0.5, output
    assert (state / "model.safetensors").is_file() and (state / "metadata.json").is_file()
    assert {p.name for p in state.glob("rng_rank*.pt")} == {f"rng_rank{r}.pt" for r in range(world_size)}


def test_raw_loop_converted_to_accelerator_one_process(tmp_path):
    out = run_script(CONVERTED, *CONVERTED_TINY, "--save-dir", tmp_path / "state", cwd=tmp_path, timeout=120)
    check_converted(out, tmp_path / "state", world_size=1)


@pytest.mark.slow
def test_raw_loop_converted_to_accelerator_two_processes_with_accumulation(tmp_path):
    # forked as torchrun starts workers; the launcher itself runs in the char_gpt test above
    env = procs.test_env(XDG_CONFIG_HOME=str(tmp_path / "xdg"))
    args = [*CONVERTED_TINY, "--grad-accum", "2", "--save-dir", tmp_path / "state"]
    out = forklaunch.launch(CONVERTED, *args, cwd=tmp_path, env=env, timeout=180).stdout
    check_converted(out, tmp_path / "state", world_size=2)


def table_rows(output, first_column):
    """{loop: [numbers]} from the rows of a printed benchmark table."""
    rows = {}
    for line in output.splitlines():
        parts = line.split()
        if parts and parts[0] in first_column:
            rows.setdefault(parts[0], []).append(
                [float(p.replace(",", "")) for p in parts[1:] if re.fullmatch(r"-?[0-9][0-9,]*\.?[0-9]*", p)]
            )
    return rows


@pytest.mark.slow
def test_benchmarks_run_and_report_every_loop(tmp_path):
    """Smoke: both benchmarks run end to end on CPU (timings are printed, never asserted)."""
    loops = ("raw", "accelerator", "trainer")
    out = run_script(
        ROOT / "benchmarks" / "overhead.py",
        *("--repeats", "1", "--warmup-repeats", "0", "--steps", "5", "--warmup", "2"),
        cwd=tmp_path,
        timeout=120,
    )
    rows = table_rows(out, loops)
    assert set(rows) == set(loops), out
    for loop in loops:  # a wall-time and a CPU-time row, each with a positive median step time
        assert len(rows[loop]) == 2 and all(r[0] > 0 for r in rows[loop]), out
    out = run_script(
        ROOT / "benchmarks" / "throughput.py",
        *("--small", "--modes", "eager", "--steps", "2", "--warmup", "1"),
        cwd=tmp_path,
        timeout=180,
    )
    rows = table_rows(out, loops + ("trainer-defaults",))
    assert set(rows) == set(loops + ("trainer-defaults",)), out
    assert all(r[0][0] > 0 and r[0][1] > 0 for r in rows.values()), out  # ms/step and tokens/s
