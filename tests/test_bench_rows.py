"""Every row of benchmarks/gpu/bench_multi_gpu.sh resolves: its `mtl train` arguments, as the
script builds them (`DRY=N` prints them instead of launching torchrun), go through
`mtl train --dry-run` at the row's world size. A typo in a row, or a row the config refuses,
fails here on the CPU instead of costing a GPU call."""

import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from mtl.cli.main import cli

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks/gpu/bench_multi_gpu.sh"


def rows(gpus: int) -> list[tuple[str, int, list[str]]]:
    """(name, processes, mtl train arguments) of every row the script runs on ``gpus`` GPUs."""
    out = subprocess.run(["bash", str(SCRIPT)], env={"PATH": "/usr/bin:/bin", "DRY": str(gpus)},
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    found = []
    for line in out.splitlines():
        tag, name, processes, args = line.split("\t")
        assert tag == "DRY_ROW", line
        found.append((name, int(processes), args.split("\x1f")))
    return found


ROWS: dict[str, tuple[int, list[str]]] = {}
for _gpus in (2, 4, 8):
    for _name, _processes, _args in rows(_gpus):
        # a row listed on both machines (the one-GPU baselines, MoE, sequence 8192) must be the same row
        assert ROWS.setdefault(_name, (_processes, _args)) == (_processes, _args), _name


def test_the_script_lists_the_scaling_rows():
    """The rows the 2-GPU scaling goals are measured with, the 4- and 8-GPU rows and FA4's
    (listed whether or not FA4 is installed here)."""
    assert {"gpu1", "dp2", "tp2_sp_mb16_async", "pp2", "pp2_vpp2", "long_gpu1", "long_cp2", "dp4",
            "tp2_dp2", "gpu1_fa4", "tp2_sp_fa4"} <= set(ROWS)
    # issue 40's, on 8 GPUs: the reference, MoE at ep=8, the 8B model in bf16 and FP8
    assert {"dp8", "tp2_dp4", "pp2_dp4", "moe_ep8"} | {f"big_{layout}_{precision}" for layout in
                                                        ("tp8", "tp4_pp2", "dp8_zero3") for precision in ("bf16", "fp8")} <= set(ROWS)


def test_the_pipeline_rows_run_the_measured_splits(monkeypatch):
    """By default (stages sized by FLOPs) the reference model's pipeline rows run the splits
    measured in the seventeenth session (benchmarks/log; the vpp ones first given by hand as
    ``parallel.virtual_stage_layers``), and the even rows the even split."""
    monkeypatch.chdir(ROOT)
    expected = {"pp2": "[13, 11]", "pp2_vpp2": "[7, 6, 6, 5]", "pp2_vpp4": "[4, 3, 3, 3, 3, 3, 3, 2]",
                "pp2_even": "(unset)", "pp2_vpp2_even": "(unset)"}
    for name, split in expected.items():
        processes, args = ROWS[name]
        result = CliRunner().invoke(cli, ["train", *args, "--dry-run"], env={"WORLD_SIZE": str(processes)})
        assert result.exit_code == 0, result.output
        assert f"virtual_stage_layers = {split}" in result.output.replace("# ", "").splitlines(), name


@pytest.mark.parametrize("name", sorted(ROWS))
def test_row_resolves(name, monkeypatch):
    processes, args = ROWS[name]
    monkeypatch.chdir(ROOT)  # the rows name their config relative to the repository
    result = CliRunner().invoke(cli, ["train", *args, "--dry-run"], env={"WORLD_SIZE": str(processes)})
    assert result.exit_code == 0, result.output
    assert f"world size {processes}:" in result.output
