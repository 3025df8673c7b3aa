"""The error-target table of `steps` (bench/steps.py): along a scene's denoising trajectory, the fixed ratio beside
the ratio the node's `ErrorTarget` gives from its `ErrorMeter`, the target set from the fixed run's measured error."""
from __future__ import annotations

import pytest
import torch

from adaptive_sparse_attention import SparseConfig
from adaptive_sparse_attention.bench import steps
from adaptive_sparse_attention.bench.cli import main
from adaptive_sparse_attention.bench.scenes import make_scene
from adaptive_sparse_attention.nodes.error_target import CAP, FLOOR, grid_position

CFG = SparseConfig(topk_ratio=0.2, min_tokens=0, kernel="torch", tiling="reblock")
TARGETS = steps.parse_targets("default,0.5x,2x")
HEADS = 1


def trajectory(name: str, heads: int = HEADS) -> list[tuple]:
    """The sparse steps (2..5) of a 6-step shift-3 schedule of scene `name` at demo size."""
    out = []
    for step, sigma in list(enumerate(steps.simple_sigmas(6, 3.0)))[2:]:
        s = make_scene(name, steps.with_heads("demo", heads, "test"), noise=steps.scene_noise(name, sigma))
        ref = torch.nn.functional.scaled_dot_product_attention(s.q, s.k, s.v)
        out.append((step, sigma, s.q, s.k, s.v, s.layout, ref))
    return out


@pytest.fixture(scope="module")
def paths():
    return {name: trajectory(name) for name in ("pan", "cuts")}


@pytest.fixture(scope="module")
def runs(paths):
    return {name: steps.target_runs(path, CFG, TARGETS) for name, path in paths.items()}


def test_targets_parse_as_multiples_of_the_fixed_error_or_errors():
    assert TARGETS == [("default", 1.0, None), ("0.5x", 0.5, None), ("2x", 2.0, None)]
    assert steps.parse_targets("0.08") == [("0.08", None, 0.08)]
    for bad in ("half", "0x", "-0.1"):
        with pytest.raises(SystemExit, match="--targets"):
            steps.parse_targets(bad)


def test_the_fixed_run_holds_its_ratio_and_the_default_target_is_its_measured_mean(runs):
    for run in runs.values():
        fixed = run["fixed"]
        assert fixed["ratios"] == [0.2] * 4 and fixed["target"] is None
        assert 0.0 < fixed["sampled_mean"] < 1.0
        assert run["targets"]["default"]["target"] == fixed["sampled_mean"]
        assert run["targets"]["0.5x"]["target"] == pytest.approx(0.5 * fixed["sampled_mean"])


def test_the_first_sparse_step_runs_at_topk_ratio_and_the_ratios_stay_within_floor_and_cap(runs):
    for run in runs.values():
        fixed = run["fixed"]
        for target in run["targets"].values():
            assert target["ratios"][0] == 0.2
            # the first step is the fixed run's call: same plan, same output, same sampled rows
            assert target["densities"][0] == fixed["densities"][0] and target["errors"][0] == fixed["errors"][0]
            assert target["sampled"][0] == fixed["sampled"][0]
            assert all(FLOOR - 1e-9 <= r <= CAP + 1e-9 for r in target["ratios"])


def test_a_target_at_the_fixed_runs_own_error_ends_within_a_grid_step_of_its_ratio(runs):
    """On the structured scenes the per-step errors of the fixed ratio stay near their mean, so the target set at
    that mean ends within one grid step of 0.2; a lower target ends denser and a higher one sparser."""
    for run in runs.values():
        ratios = {name: x["ratios"][-1] for name, x in run["targets"].items()}
        assert abs(grid_position(ratios["default"]) - grid_position(0.2)) <= 1 + 1e-9
        assert ratios["0.5x"] > 0.2 > ratios["2x"]
        half, double = run["targets"]["0.5x"], run["targets"]["2x"]
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        assert mean(half["errors"]) < mean(run["fixed"]["errors"]) < mean(double["errors"])


def test_each_call_is_made_as_the_node_makes_it(monkeypatch, paths):
    """Every timed call hands its sampled sums to the meter with the node's rotation (step + block 0)."""
    seen = []
    attention = steps.sparse_attention

    def spy(q, k, v, layout, config, **kw):
        if "error_sink" in kw:
            seen.append((kw["error_rotation"], config.topk_ratio, kw["error_sink"] is not None))
        return attention(q, k, v, layout, config, **kw)

    monkeypatch.setattr(steps, "sparse_attention", spy)
    path = paths["cuts"][:2]
    runs = steps.target_runs(path, CFG, [("2x", 2.0, None)])
    made = [(step, ratio) for step, ratio, _ in seen]
    wanted = list(zip(runs["fixed"]["steps"], runs["fixed"]["ratios"]))
    wanted += [x for x in zip(runs["targets"]["2x"]["steps"], runs["targets"]["2x"]["ratios"]) if x not in wanted]
    assert made == wanted and all(x for _, _, x in seen)  # each step and ratio once, the first target step reused
    assert runs["targets"]["2x"]["ratios"][1] < 0.2  # the second target step ran a call of its own


def test_the_table_runs_alone_and_gaussian_is_a_static_control(capsys):
    code = main(["steps", "--size", "demo", "--heads", "1", "--scenes", "pan,gaussian", "--ratios", "0.2",
                 "--steps", "4", "--warmup-ratio", "0.4", "--kernel", "torch", "--device", "cpu", "--tables", "target",
                 "--targets", "default,2x"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("demo with 1 head, 4 steps"), out
    assert "| scene | ratio | rule | target err |" in out and "fidelity density" not in out, out
    assert "| pan | 0.2 | fixed 0.2 | - | 2 | 0.200, 0.200 |" in out, out
    assert "| gaussian | 0.2 | target default |" in out and "| pan | 0.2 | target 2x |" in out, out
    assert "drift limit" not in out
    assert steps.scene_noise("gaussian", 0.9) == 0.0 and steps.scene_noise("pan", 1.2) == 1.0
