"""Config: the CLI generated from the dataclass, YAML under flags, validation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ddptrain.config import ConfigError, TrainingConfig
from ddptrain.config_cli import build_parser, parse_config


def test_every_field_is_a_flag_with_its_default_and_help() -> None:
    text = build_parser().format_help()
    for f in dataclasses.fields(TrainingConfig):
        if f.metadata.get("internal"):  # ddptrain's own record (given_in_python): no flag
            assert f"--{f.name}" not in text, f.name
            continue
        assert f"--{f.name}" in text, f.name
        assert f.metadata["help"].split()[0] in text
    assert "--no-use_amp" in text and "--config FILE.yaml" in text
    assert "(default: 64)" in text  # batch_size


def test_help_groups_every_flag_under_its_section() -> None:
    from ddptrain.config import SECTIONS

    fields = dataclasses.fields(TrainingConfig)
    settings = [f.name for f in fields if not f.metadata.get("internal")]
    placed = [name for _, names in SECTIONS.values() for name in names]
    assert sorted(placed) == sorted(settings)  # each in exactly one section
    groups = {g.title: [a.dest for a in g._group_actions] for g in build_parser()._action_groups}
    for section, (_, names) in SECTIONS.items():
        assert groups[section] == list(names), section
    text = build_parser().format_help()
    order = [text.index(f"\n{section}:\n") for section in SECTIONS]
    assert order == sorted(order)
    assert text.index("--lr FLOAT") > text.index("\noptimization:\n") > text.index("--width")


def test_a_config_file_may_nest_its_fields_under_their_sections(tmp_path: Path) -> None:
    flat = tmp_path / "flat.yaml"
    flat.write_text("model: gpt\nwidth: 32\nlr: 0.5\nepochs: 3\ntp: 1\nseed: 4\n")
    nested = tmp_path / "nested.yaml"
    nested.write_text(
        "model:\n  model: gpt\n  width: 32\noptimization: {lr: 0.5, epochs: 3}\n"
        "parallel:\n  tp: 1\nseed: 4\n"  # sections and flat fields mixed
    )
    want = parse_config(["--config", str(flat)])
    assert (want.model, want.width, want.lr, want.epochs, want.seed) == ("gpt", 32, 0.5, 3, 4)
    assert parse_config(["--config", str(nested)]) == want
    assert parse_config(["--config", str(nested), "--lr", "0.1"]).lr == 0.1  # flags win


@pytest.mark.parametrize(
    ("yaml_text", "needle"),
    [
        ("data:\n  lr: 0.1\n", "'lr' under data: is a field of optimization:, not of data:"),
        ("optimization:\n  lrr: 0.1\n", "'lrr' under optimization: is no field"),
        ("lr: 0.2\noptimization: {lr: 0.1}\n", "gives 'lr' twice"),
    ],
)
def test_a_field_under_the_wrong_section_is_refused(
    tmp_path: Path, yaml_text: str, needle: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as err:
        parse_config(["--config", str(path)])
    assert needle in str(err.value)


def test_seed_spellings_parse() -> None:
    cfg = parse_config(
        ["--batch_size", "128", "--no-use_amp", "--lr", "0.1", "--grad_accum_steps", "2",
         "--resume_from", "auto", "--max_grad_norm", "1.5", "--amp_dtype", "bfloat16"]
    )
    assert (cfg.batch_size, cfg.use_amp, cfg.lr, cfg.grad_accum_steps) == (128, False, 0.1, 2)
    assert (cfg.resume_from, cfg.max_grad_norm, cfg.amp_dtype) == ("auto", 1.5, "bfloat16")
    assert parse_config([]) == TrainingConfig()


def test_yaml_values_sit_under_flags(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("lr: 0.5\nepochs: 3\nuse_amp: false\nweight_decay: 0\n")
    cfg = parse_config(["--config", str(path), "--epochs", "7"])
    assert (cfg.lr, cfg.epochs, cfg.use_amp, cfg.weight_decay) == (0.5, 7, False, 0.0)


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    from ddptrain.config_cli import dump_yaml

    cfg = parse_config(["--dataset", "digits", "--lr", "0.2", "--max_grad_norm", "2"])
    dump_yaml(cfg, tmp_path / "config.yaml")
    assert parse_config(["--config", str(tmp_path / "config.yaml")]) == cfg


@pytest.mark.parametrize(
    ("yaml_text", "needle"),
    [
        ("lr: [1, 2\n", "not valid YAML"),
        ("lrr: 0.1\n", "unknown field(s) lrr"),
        ("epochs: ten\n", "epochs: 'ten'"),
        ("use_amp: 3\n", "use_amp"),
        ("- 1\n- 2\n", "mapping"),
        ("backend: mpi\n", "backend"),
    ],
)
def test_bad_yaml_is_refused(tmp_path: Path, yaml_text: str, needle: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match=None) as err:
        parse_config(["--config", str(path)])
    assert needle in str(err.value)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--batch_size", "0"], "--batch_size 0 is invalid"),
        (["--grad_accum_steps", "0"], "--grad_accum_steps 0 is invalid"),
        (["--epochs", "-1"], "--epochs -1 is invalid"),
        (["--lr", "-1"], "--lr -1.0 is invalid"),
        (["--ema_decay", "1"], "--ema_decay 1.0 is invalid"),
        (["--export_ema"], "--export_ema True is invalid"),
        (["--early_stopping", "-1"], "--early_stopping -1 is invalid"),
        (["--val_fraction", "1.5"], "--val_fraction 1.5 is invalid"),
        (["--dataset", "imagenet"], "--dataset 'imagenet' is invalid"),
        (["--dataset", "missing.npz"], "no such file"),
        (["--model", "resnet50"], "--model 'resnet50' is invalid"),
        (["--num_classes", "1"], "at least 2 classes"),
        (["--resume_from", "nope.pt"], "--resume_from 'nope.pt' is invalid"),
        (["--batch_sise", "3"], "unrecognized arguments: --batch_sise"),
        (["--batch_size", "many"], "expected int, got 'many'"),
        (["--backend", "mpi"], "invalid choice: 'mpi'"),
        (["--max_grad_norm", "-1"], "--max_grad_norm -1.0 is invalid"),
        (["--straggler_factor", "0.5"], "--straggler_factor 0.5 is invalid: use a factor above 1"),
        (["--spike_factor", "1"], "--spike_factor 1.0 is invalid: use a factor above 1, or 0"),
        (["--spike_rows", "0"], "--spike_rows 0 is invalid: use a whole number of at least 1"),
        (["--skip_steps", "9-3"], "--skip_steps '9-3' is invalid: give optimizer steps as STEP"),
        (["--skip_steps", "0"], "--skip_steps '0' is invalid: give optimizer steps as STEP"),
        (["--on_spike", "rollback", "--spike_factor", "0"],
         "--on_spike 'rollback' is invalid: give --spike_factor above 1 too"),
        (["--max_rollbacks", "-1"], "--max_rollbacks -1 is invalid: use a whole number of 0"),
    ],
)
def test_bad_values_name_field_value_and_fix(argv: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(argv)
    assert needle in str(err.value)


def test_tensor_and_pipeline_parallel_runs_checkpoint_as_dcp_and_may_save_in_background() -> None:
    """Their ranks each write a share: `--checkpoint_format auto` is DCP, which background
    saves write, so `--async_checkpoint` asks for nothing more."""
    for layout in ({"tp": 2}, {"pp": 2}, {"strategy": "fsdp"}):
        config = parse_config(["--async_checkpoint", *(
            f"--{k}={v}" for k, v in layout.items())])
        assert config.checkpoint_kind == "dcp", layout
    assert parse_config([]).checkpoint_kind == "file"
    with pytest.raises(ConfigError, match="background saves write DCP step directories"):
        parse_config(["--async_checkpoint"])


def test_each_section_checks_its_own_fields_and_no_others() -> None:
    """`validate` runs one check a section (`config_checks.SECTION_CHECKS`, one for every
    entry of SECTIONS), and a check refuses only fields of its section: a refusal lives
    with the fields it is about."""
    import ast
    import inspect
    import textwrap

    from ddptrain.config import SECTIONS
    from ddptrain.config_checks import SECTION_CHECKS

    assert list(SECTION_CHECKS) == list(SECTIONS)
    for section, (_, fields) in SECTIONS.items():
        check = SECTION_CHECKS[section]
        tree = ast.parse(textwrap.dedent(inspect.getsource(check)))
        refused = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
                name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                literals = [a.value for a in node.args if isinstance(a, ast.Constant)
                            and isinstance(a.value, str) and a.value.isidentifier()]
                if name == "_bad":
                    refused.update(literals[:1])
                elif name == "_at_least":  # (minimum, fix, *fields): the fields
                    refused.update(literals)
        assert refused <= set(fields), (section, refused - set(fields))


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--seed", "-1"], "--seed -1 is invalid: use a whole number in 0..4294967295"),
        (["--seed", str(2**32)], f"--seed {2**32} is invalid: use a whole number in 0.."),
        (["--seed", "1e23"], "expected int, got '1e23': give a whole number in digits"),
        (["--width", "1000000000"], "--width 1000000000 is invalid: use at most 1,048,576"),
        (["--pack", "--block_size", "1"], "--block_size 1 is invalid: --pack predicts"),
    ],
)
def test_seeds_widths_and_packed_windows_out_of_range_are_refused(
    argv: list[str], needle: str
) -> None:
    """Values every derived seed (seed + rank, + epoch, + a 32-bit hash) and numpy take;
    widths a host can hold; packed windows with a token to predict."""
    with pytest.raises(ConfigError) as err:
        parse_config(argv)
    assert needle in str(err.value)


def test_the_seed_bounds_themselves_parse_and_a_yaml_float_seed_is_refused(
    tmp_path: Path
) -> None:
    assert parse_config(["--seed", "0"]).seed == 0
    assert parse_config(["--seed", str(2**32 - 1)]).seed == 2**32 - 1
    assert parse_config(["--pack", "--block_size", "2"]).block_size == 2
    path = tmp_path / "run.yaml"
    path.write_text("seed: 1.0e+23\n")  # a whole float: read as an int, then out of range
    with pytest.raises(ConfigError, match="--seed 99999999999999991611392 is invalid"):
        parse_config(["--config", str(path)])
