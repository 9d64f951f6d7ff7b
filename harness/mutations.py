"""`python -m harness mutations`: the parity checks against plausible wrong networks (core/mutations.py). Each
forward mutant is computed by a rung itself (its weights, its input, or its launches made wrong) at every dtype the
rung runs, and judged by the ladder's own checks (core.parity.verdict against the references the prepare stage
makes); each training mutant is a rung's step (eager's, triton's) with its backward made wrong, judged by
core.train.compare. Every row must fail, and the right network ("none") pass. Rows: mutations.json (a list), a
table per task in mutations.md.

In-process and one forward per row, so it takes the Python rungs (eager, triton); the C++ rungs are held to the
same checks in every ladder cell. The triton rung's structural mutants change its launches in Python, so they run
it with pairs and chains off and through Triton's own launch path (option values a user can set)."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from core import train
from core.cell import DTYPES, Built, Cell, Store
from core.env import device_slug, environment
from core.files import write_text_atomic
from core.model import build_model, make_input, training_start
from core.mutations import FORWARD, RIGHT, TRAINING, Mutant, check_names, mutant_input, shift_window
from core.parity import run_stages, stage_errors, verdict
from core.placement import memory_format, set_math_mode, torch_dtype
from core.recipes import folded_recipe, recipe_output
from harness.results.tables import markdown_table
from harness.run.context import shipped_tunings
from harness.run.record import recipe_references
from tiers import get_tier

RUNGS = ("eager", "triton")
STRUCTURE_OPTIONS = (("chain", "off"), ("launch", "jit"), ("pairs", "off"))


@dataclass(frozen=True)
class MutationConfig:
    model: str = "resnet50"
    batch: int = 8
    res: int = 224
    device: str = "cuda"
    rungs: tuple[str, ...] = RUNGS
    dtypes: tuple[str, ...] = DTYPES
    mutants: tuple[str, ...] = ()  # forward and training mutants by name; empty: all
    train_dtypes: tuple[str, ...] = ("fp32", "bf16")
    train_batch: int = 8
    train_res: int = 64


def forward_rows(config: MutationConfig, on_row: Callable[[dict], None] = lambda r: None) -> list[dict]:
    """One row per (rung, dtype, mutant): the right network and every forward mutant, each through the checks."""
    mutants = [RIGHT, *chosen(config, FORWARD)]
    model = build_model(config.model)
    x = make_input(config.batch, config.res).to(config.device)
    set_math_mode("fp32")
    with torch.inference_mode():
        ref = model.to(config.device)(x).float()
        other = model(make_input(config.batch, config.res, seed=1).to(config.device)).float()
    model = model.cpu()
    gpu = device_slug(environment(config.device)) if config.device == "cuda" else None
    rows = []
    for rung in config.rungs:
        tier = get_tier(rung)
        for dtype in config.dtypes:
            cell = Cell(tier=rung, model=config.model, batch=config.batch, res=config.res, dtype=dtype,
                        channels_last=True, device=config.device)
            if not runs(tier, cell):
                continue
            # the references the ladder's prepare stage makes for this cell (harness/run/record.py)
            refs, stage_refs = {}, None
            for k, (name, at, layout) in recipe_references(cell).items():
                if name == "eager":
                    refs[k] = (name, recipe_output(name, model, x, at, layout != "nchw"))
                else:  # a folded recipe: its stages too, the last of them its logits
                    stage_refs = folded_recipe(name, model, x, at).stage_outputs(x)
                    refs[k] = (name, stage_refs[-1][1])
            eager = refs["eager"][1] if "eager" in refs else None
            recipe_ref = refs.get("recipe")
            for mutant in mutants:
                out, built = _rung_output(tier, cell, mutant, model, x, Store(tunings=shipped_tunings(gpu, rung)))
                stages = None
                if stage_refs is not None and built.stages:
                    stages = stage_errors(run_stages(built.stages(), mutant_input(mutant, x).to(config.device),
                                                     stage_refs), stage_refs)
                parity = verdict(out, ref, dtype, other, eager, recipe_ref, stages)
                band = verdict(out, ref, dtype, other)  # the checks against fp32 alone, as before recipes
                recipe_figures, stage_figures = parity.get("recipe") or {}, parity.get("stages") or {}
                row = {"task": "infer", "mutant": mutant.name, "dtype": dtype, "rung": rung, "ok": parity["ok"],
                       "band_ok": band["ok"], "rel_err": parity.get("rel_err"),
                       "recipe_rel_err": recipe_figures.get("norm_rel_err"),
                       "recipe_max_rel_err": recipe_figures.get("rel_err"),
                       "ratio_to_eager": parity.get("ratio_to_eager"), "reason": parity.get("reason"),
                       "stage_err": stage_figures.get("value"), "stage_measure": stage_figures.get("measure"),
                       "worst_stage": stage_figures.get("worst"),
                       "stage_judged": stage_figures.get("ok") is not None,
                       "bug": mutant.bug, "kind": mutant.kind, "target": mutant.target}
                rows.append(row)
                on_row(row)
    return rows


def chosen(config: MutationConfig, suite: tuple[Mutant, ...]) -> list[Mutant]:
    """The mutants of `suite` that the config names (all of them where it names none at all)."""
    check_names(list(config.mutants), FORWARD + TRAINING)
    return [m for m in suite if m.name in config.mutants] if config.mutants else list(suite)


def runs(tier, cell: Cell) -> bool:
    """Whether the rung computes this cell here: the ladder's rule, except that on the CPU eager also runs its
    16-bit dtypes (slowly, but their checks are what the CPU test guards; the interpreter has no bf16)."""
    if tier.availability(cell.device) or cell.dtype not in tier.dtypes:
        return False
    if cell.device == "cpu" and tier.name == "eager":
        return cell.dtype in ("fp32", "fp16", "bf16")
    return tier.supports(cell) is None


def _rung_output(tier, cell: Cell, mutant: Mutant, model, x: torch.Tensor, store: Store) -> tuple[torch.Tensor, Built]:
    """The rung's logits for the mutant and its build that computed them: built on its (wrong) weights and fed
    its (wrong) input, or, for a structural mutant of a rung other than eager, built on the right weights with its
    launches changed."""
    set_math_mode(cell.dtype)
    structural = mutant.kind == "structure" and tier.name != "eager"
    if structural:
        cell = replace(cell, options=STRUCTURE_OPTIONS)
    example = mutant_input(mutant, x).to(torch_dtype(cell.dtype)).contiguous(
        memory_format=memory_format(cell.channels_last))
    # a copy: a build may convert the module it is given in place (eager's place_model)
    built = tier.build(copy.deepcopy(model) if structural else mutant.model(copy.deepcopy(model)), example, cell,
                       store)
    if structural:
        _break_launches(built.forward, mutant)
    with torch.inference_mode():
        return built.forward(example).float(), built


def _break_launches(net: Any, mutant: Mutant) -> None:
    """The triton rung's network with the structural mutant's bug in the launch of the convolution it names: its
    block's last convolution without ReLU or without the residual, or a convolution on a window one pixel off."""
    plain = net.conv
    last = max((p for p in net.paths.values() if p.startswith(mutant.target + ".conv")), default=None)

    def conv_of(x, p, **kwargs):
        path = net.paths.get(id(p))
        if mutant.name == "padding-off-by-one" and path == mutant.target:
            x = shift_window(x, (1, 2)).contiguous()  # NHWC
        elif mutant.name == "relu-dropped" and path == last:
            kwargs["relu"] = False
        elif mutant.name == "residual-dropped" and path == last:
            kwargs["residual"] = kwargs["residual_scale"] = None
        return plain(x, p, **kwargs)

    net.conv = conv_of


def training_rows(config: MutationConfig, on_row: Callable[[dict], None] = lambda r: None) -> list[dict]:
    """One row per (rung, dtype, mutant): the rung's training step (its build_train) with the mutant's backward,
    against eager fp32 (NCHW, strict), as the ladder's training cells are judged. A mutant is a gradient hook on
    the parameters, which autograd runs and the triton step runs as autograd does."""
    mutants = [RIGHT, *chosen(config, TRAINING)]
    start = training_start(build_model(config.model))
    initial = {k: v.detach().float().clone() for k, v in start.state_dict().items()}
    x = make_input(config.train_batch, config.train_res).to(config.device)
    ref = _steps(start, x, "eager", "fp32", False, None, config)
    rows = []
    for rung in config.rungs:
        for dtype in config.train_dtypes:
            cell = Cell(tier=rung, model=config.model, batch=config.train_batch, res=config.train_res, dtype=dtype,
                        channels_last=True, device=config.device, task="train")
            if not runs(get_tier(rung), cell):
                continue
            for mutant in mutants:
                out = _steps(start, x, rung, dtype, True, mutant.change, config)
                parity = train.compare(out, ref, initial, dtype)
                row = {"task": "train", "mutant": mutant.name, "dtype": dtype, "rung": rung, "ok": parity["ok"],
                       "rel_err": parity.get("rel_err"), "worst_group": parity.get("worst_group"),
                       "worst_group_gain": parity.get("worst_group_gain"), "reason": parity.get("reason"),
                       "bug": mutant.bug, "kind": mutant.kind, "target": mutant.target}
                rows.append(row)
                on_row(row)
    return rows


def _steps(start, x, rung: str, dtype: str, channels_last: bool, hook, config: MutationConfig
           ) -> dict[str, torch.Tensor]:
    set_math_mode(dtype)
    cell = Cell(tier=rung, model=config.model, batch=x.shape[0], res=x.shape[-1], dtype=dtype,
                channels_last=channels_last, device=config.device, task="train")
    net = train.place_for_training(copy.deepcopy(start), cell)
    if hook:
        hook(net)
    x = x.contiguous(memory_format=memory_format(channels_last))
    built = get_tier(rung).build_train(net, x, cell, Store())
    losses = [built.forward(x) for _ in range(train.K_STEPS)]
    return train.output_tensors(losses, built.state())


def run(config: MutationConfig, out_dir: Path | None) -> list[dict]:
    """Both suites, each row printed as it ends; mutations.json and mutations.md in `out_dir`."""
    def show(row: dict) -> None:
        verdict_ = "pass" if row["ok"] else "FAIL"
        print(f"{row['task']:5} {row['rung']:7} {row['dtype']:5} {row['mutant']:26} {verdict_}  "
              f"rel err {row['rel_err']:.2e}" + (f"  recipe {row['recipe_rel_err']:.2e} (max {row['recipe_max_rel_err']:.2e})"
                                                  if row.get("recipe_rel_err") is not None else "")
              + (f"  stage {row['worst_stage']} {row['stage_err']:.2e} ({row['stage_measure']})" if row.get("worst_stage") else ""),
              flush=True)

    rows = forward_rows(config, show) + training_rows(config, show)
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out_dir / "mutations.json", json.dumps(rows, indent=1))
        write_text_atomic(out_dir / "mutations.md", markdown(rows, config))
    return rows


def caught(rows: list[dict]) -> bool:
    """Whether the suite did its job: every mutant failed and the right network passed, in every row."""
    return all(r["ok"] == (r["mutant"] == "none") for r in rows)


def markdown(rows: list[dict], config: MutationConfig) -> str:
    """A table per task: a row per mutant, a column per rung and dtype, each cell the verdict and the error that
    decided it (against the recipe where the rung has one, else against eager fp32)."""
    parts = [f"# Parity against wrong networks: {config.model}, batch {config.batch}, res {config.res} "
             f"(training: batch {config.train_batch}, res {config.train_res})\n",
             f"Every mutant must fail and `none` pass: **{'all as they must' if caught(rows) else 'NOT ALL CAUGHT'}**."
             " A cell: `fail`/`pass`, then the error that decided it (forward: ||out - recipe|| / ||recipe|| against "
             "the rung's recipe at the dtype where it has one, of the worst stage where the stages are judged (fp8: "
             "each block fed the recipe's input; `codes`: a block stored in e4m3, the share of its e4m3 codes that "
             "differ from the recipe's), else max|out - ref| / max|ref| against eager fp32; "
             "training: the worst parameter tensor's gain).\n"]
    for task in ("infer", "train"):
        mine = [r for r in rows if r["task"] == task]
        table = []
        for name in dict.fromkeys(r["mutant"] for r in mine):
            line = {"mutant": name}
            for r in (r for r in mine if r["mutant"] == name):
                figure = (f"gain {r['worst_group_gain']:.2f}" if task == "train" else
                          f"{r['worst_stage']} {r['stage_err']:.1e} {r['stage_measure']}" if r.get("stage_judged") else
                          f"{r['recipe_rel_err'] if r.get('recipe_rel_err') is not None else r['rel_err']:.1e}")
                line[f"{r['rung']} {r['dtype']}"] = f"{'pass' if r['ok'] else 'fail'} {figure}"
            table.append(line)
        if table:
            parts.append(f"\n## {'Forward' if task == 'infer' else 'Training step'}\n\n"
                         + "\n".join(markdown_table(table)) + "\n")
    return "".join(parts)
