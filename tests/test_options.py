"""The option table (trioserve/options.py) is the one declaration of each
`serve` option: the attrs fields, the TRIOSERVE_* variables, the flags and
docs/configuration.md's table are all made from it, and agree."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from trioserve import cli, options
from trioserve.config import EngineConfig, ServerSettings, settings_from_env
from trioserve.option_kinds import BYTES, BYTES_OR_AUTO, MILLISECONDS, PORT, POSITIVE_INT, SECONDS, STATE_URL, SWITCH, TEXT
from trioserve.options import OPTIONS, Option

DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
SETTINGS = [opt for opt in OPTIONS if opt.field]
VARIABLES = [opt for opt in SETTINGS if opt.env]
# A value other than the default, as a flag or a variable spells it, and as the field holds it.
SAMPLES = {
    TEXT: ("elsewhere", "elsewhere"),
    POSITIVE_INT: ("100", 100),
    PORT: ("8080", 8080),
    SECONDS: ("2.5", 2.5),
    MILLISECONDS: ("250", 250.0),
    BYTES: ("3MiB", 3 << 20),
    BYTES_OR_AUTO: ("16KiB", 16 << 10),
    STATE_URL: ("postgresql://u@db:5432/state", "postgresql://u@db:5432/state"),
}


def _sample(opt: Option) -> tuple[str, object]:
    if opt.field == "loras":  # NAME=PATH pairs, no variable
        return "tuned=/adapters/tuned", (("tuned", "/adapters/tuned"),)
    if opt.field == "api_key":  # repeatable: each key a tenant
        return "elsewhere", ("elsewhere",)
    if opt.choices:
        other = next(c for c in opt.choices if c != opt.default)
        return other, other
    return SAMPLES[opt.kind]


def _holder(opt: Option, settings: ServerSettings):
    return settings.engine if opt.field.startswith("engine.") else settings


def _serve(*argv: str, environ: dict[str, str] | None = None) -> ServerSettings:
    return cli.serve_settings(cli.build_parser().parse_args(["serve", *argv]), environ or {})


def test_the_docs_table_is_the_generated_one():
    text = DOCS.read_text(encoding="utf-8")
    assert options.with_table(text) == text, "docs/configuration.md: run `python -m trioserve.options --write docs/configuration.md`"
    assert options.markdown_table().count("\n") == len(OPTIONS) + 2


def test_the_module_prints_the_table(capsys):
    assert options.main(["--markdown"]) == 0
    assert capsys.readouterr().out == options.markdown_table()


def test_every_setting_is_an_attrs_field_with_the_tables_default():
    fields = {**{f"engine.{f.name}": f for f in attrs.fields(EngineConfig)}, **{f.name: f for f in attrs.fields(ServerSettings)}}
    for opt in SETTINGS:
        field = fields[opt.field]
        assert field.default == opt.default and field.metadata["option"] is opt, opt.field
    declared = {name for name, f in fields.items() if "option" in f.metadata}
    assert declared == {opt.field for opt in SETTINGS}
    assert len({opt.flag for opt in OPTIONS}) == len(OPTIONS) and len({opt.env for opt in VARIABLES}) == len(VARIABLES)


def test_no_flags_and_no_variables_give_the_fields_defaults():
    assert settings_from_env({}) == ServerSettings()
    # A served model name defaults to the --model value on the command line (the app's own default is the checkpoint's).
    assert _serve() == ServerSettings(served_model_name="smollm2")


@pytest.mark.parametrize("opt", [o for o in OPTIONS if o.default is not None and o.shown_default is None], ids=lambda o: o.flag)
def test_the_default_the_docs_show_is_the_default_a_flag_and_a_variable_read(opt):
    shown = options.shown_default(opt).strip("`")
    if opt.env:
        assert opt.parse_variable(shown) == opt.default
    if opt.kind is not SWITCH:
        assert opt.kind.flag(shown) == opt.default


def test_the_serve_flags_are_the_table():
    (serve,) = [p for a in cli.build_parser()._subparsers._group_actions for name, p in a.choices.items() if name == "serve"]
    flags = {s for action in serve._actions for s in action.option_strings} - {"-h", "--help"}
    assert flags == {opt.flag for opt in OPTIONS} | {"--no-batch-invariant"}
    for action in serve._actions:
        opt = next((o for o in OPTIONS if o.flag in action.option_strings), None)
        if opt is not None:
            assert action.choices == opt.choices and action.dest == opt.dest, opt.flag
    assert "--max-num-seqs" in serve.format_help()  # every help text formats ("90%" included)


@pytest.mark.parametrize("opt", [o for o in SETTINGS if o.kind is not SWITCH], ids=lambda o: o.flag)
def test_each_flag_and_variable_fills_its_field(opt):
    text, value = _sample(opt)
    assert getattr(_holder(opt, _serve(opt.flag, text)), opt.name) == value
    if opt.env:
        assert getattr(_holder(opt, settings_from_env({opt.env: text})), opt.name) == value


@pytest.mark.parametrize("opt", [o for o in SETTINGS if o.kind is SWITCH], ids=lambda o: o.flag)
def test_each_switch_and_variable_fills_its_field(opt):
    flag = f"--no-{opt.flag[2:]}" if opt.negatable else opt.flag
    assert getattr(_holder(opt, _serve(flag)), opt.name) is not opt.default
    assert getattr(_holder(opt, settings_from_env({opt.env: str(not opt.default)})), opt.name) is not opt.default
    assert getattr(_holder(opt, settings_from_env({opt.env: str(opt.default)})), opt.name) is opt.default


def test_flags_that_read_their_variable_and_flags_that_do_not():
    env = {"TRIOSERVE_KERNELS": "reference", "TRIOSERVE_RECORD": "/tmp/traces", "TRIOSERVE_KV_HUGE_PAGES": "on", "TRIOSERVE_MAX_NUM_SEQS": "4"}
    s = _serve(environ=env)
    assert (s.engine.kernels, s.engine.record_dir, s.engine.kv_huge_pages) == ("reference", "/tmp/traces", True)
    assert s.engine.max_num_seqs == 32  # only settings_from_env reads this one
    assert _serve("--kernels", "auto", environ=env).engine.kernels == "auto"  # the flag wins
    with pytest.raises(ValueError, match="TRIOSERVE_ACTIVATIONS: must be one of auto, bf16, int8, got 'int4'"):
        _serve(environ={"TRIOSERVE_ACTIVATIONS": "int4"})
    assert _serve("--served-model-name", "mine").served_model_name == "mine"
    assert {o.flag for o in OPTIONS if o.flag_reads_env} == {
        "--kernels", "--activations", "--kv-cache-dtype", "--kv-huge-pages", "--batch-invariant", "--record"
    }  # fmt: skip


@pytest.mark.parametrize("opt", [o for o in SETTINGS if o.choices], ids=lambda o: o.flag)
def test_choices_are_checked_by_one_function(opt, capsys):
    name, shown = opt.name, ", ".join(opt.choices)
    with pytest.raises(ValueError, match=f"^{name} must be one of {shown}, got 'bogus'$"):
        attrs.evolve(_holder(opt, ServerSettings()), **{name: "bogus"})
    if opt.env:
        with pytest.raises(ValueError, match=f"^{opt.env}: must be one of {shown}, got 'bogus'$"):
            settings_from_env({opt.env: "bogus"})
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", opt.flag, "bogus"])
    assert f"argument {opt.flag}: invalid choice: 'bogus'" in capsys.readouterr().err


def test_the_kernels_refuse_a_bad_choice_with_the_settings_words():
    torch = pytest.importorskip("torch")
    from trioserve.kernels.ops import select_kernels

    for field, args in (("kernels", ("fast", "auto")), ("activations", ("auto", "fp8"))):
        with pytest.raises(ValueError) as settings:
            EngineConfig(**{field: "fast" if field == "kernels" else "fp8"})
        with pytest.raises(ValueError) as kernels:
            select_kernels(args[0], torch.device("cpu"), torch.float32, 4, 2, 16, args[1])
        assert str(kernels.value) == str(settings.value)


def test_the_docs_cells():
    by_flag = {opt.flag: opt for opt in OPTIONS}
    assert options.shown_default(by_flag["--kv-cache-bytes"]) == "`512MiB`"
    assert options.shown_default(by_flag["--send-buffer-bytes"]) == "`64KiB`"
    assert options.shown_default(by_flag["--session-idle"]) == "`3600`"
    assert options.shown_default(by_flag["--no-prefix-cache"]) == "on"
    table = options.markdown_table()
    assert "| `--batch-invariant` / `--no-batch-invariant` | `TRIOSERVE_BATCH_INVARIANT` | on |" in table
    assert "| `--no-prefix-cache` | `TRIOSERVE_PREFIX_CACHE=false` | on |" in table
    assert "| `--record DIR` | `TRIOSERVE_RECORD` | off |" in table
    assert "| `--host` | | `127.0.0.1` | address to bind |" in table
    assert "(`<\\|im_start\\|>`)" in table  # a pipe inside a cell is escaped
    with pytest.raises(ValueError, match="markers"):
        options.with_table("no table here\n")
