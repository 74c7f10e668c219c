"""Presets: every shipped file loads; --spec auto only picks what was measured to pay on the
hardware class; a bad file names its problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import presets
from engine.config import SPEC_METHODS
from engine.presets import PresetError, SpecEntry, choose_spec


def test_every_shipped_preset_loads():
    shipped = presets.shipped()
    assert {"bundled", "qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-9b", "qwen3.5-27b",
            "qwen3.6-27b"} <= set(shipped)
    for p in shipped.values():
        assert p.path.name == f"{p.name}.toml"
        assert set(p.spec) <= set(presets.HARDWARE_CLASSES)
        for entry in p.spec.values():
            assert entry.method in SPEC_METHODS
            # a number is only ever recorded next to measured = true, with its source
            assert entry.measured == (entry.speedup is not None) == (entry.source is not None)
        if p.model.startswith(presets.BUNDLED_PREFIX):
            assert (presets.bundled_path(p.model) / "config.json").is_file()


def test_find_by_name_and_by_file(tmp_path):
    assert presets.find("bundled").name == "bundled"
    f = tmp_path / "mine.toml"
    f.write_text('name = "mine"\ndescription = "x"\nmodel = "org/model"\nmax_context = 1024\n')
    assert presets.find(str(f)).max_context == 1024
    with pytest.raises(PresetError, match="no preset named 'nope'.*bundled"):
        presets.find("nope")
    with pytest.raises(PresetError, match="does not exist"):
        presets.find(str(tmp_path / "missing.toml"))


def test_for_model_matches_bundled_and_repo_ids():
    assert presets.for_model(None).name == "bundled"
    assert presets.for_model(str(presets.bundled_path("bundled:target"))).name == "bundled"
    assert presets.for_model("mlx-community/qwen3.5-9b-4bit@main").name == "qwen3.5-9b"
    assert presets.for_model("someone/unknown") is None


def _preset(**entries: SpecEntry) -> presets.Preset:
    return presets.Preset(name="p", description="", model="org/m", path=Path("p.toml"), spec=dict(entries))


def test_auto_never_picks_what_was_not_measured_to_pay():
    unmeasured = SpecEntry(method="ngram")
    slower = SpecEntry(method="ngram", measured=True, speedup=0.95, tokens_per_forward=1.8, source="s")
    faster = SpecEntry(method="draft", budget=8, depth=4, measured=True, speedup=1.3, tokens_per_forward=2.5,
                       source="s", draft_model="org/draft")
    assert choose_spec(None, "cpu").method == "none"
    assert "no preset" in choose_spec(None, "cpu").reason
    assert choose_spec(_preset(cpu=unmeasured), "cpu").method == "none"
    assert "not measured" in choose_spec(_preset(cpu=unmeasured), "cpu").reason
    assert choose_spec(_preset(cpu=slower), "cpu").method == "none"
    assert "no faster" in choose_spec(_preset(cpu=slower), "cpu").reason
    assert choose_spec(_preset(cpu=faster), "nvidia-gpu").method == "none"
    picked = choose_spec(_preset(cpu=faster), "cpu")
    assert (picked.method, picked.budget, picked.depth, picked.draft_model) == ("draft", 8, 4, "org/draft")
    assert picked.tree is None  # the CLI's default builder


def test_auto_carries_the_tree_builder_it_was_measured_with():
    chain = SpecEntry(method="mtp", tree="chain", measured=True, speedup=1.1, tokens_per_forward=1.5, source="s")
    picked = choose_spec(_preset(cpu=chain), "cpu")
    assert (picked.method, picked.tree) == ("mtp", "chain")
    assert "measured 1.10x plain decoding with chain trees" in picked.reason


@pytest.mark.parametrize("body, problem", [
    ('model = "m"\ndescription = "d"\n', "missing key 'name'"),
    ('name = "n"\ndescription = "d"\nmodel = "m"\nmax_ctx = 3\n', "unknown key 'max_ctx'"),
    ('name = "n"\ndescription = "d"\nmodel = "m"\nmax_context = "big"\n', "max_context has the wrong type"),
    ('name = "n"\ndescription = "d"\nmodel = "m"\ndtype = "int8"\n', "dtype must be one of"),
    ('name = "n"\ndescription = "d"\nmodel = "m"\n[spec.tpu]\nmethod = "ngram"\n', "unknown hardware class 'tpu'"),
    ('name = "n"\ndescription = "d"\nmodel = "m"\n[spec.cpu]\nmethod = "magic"\n', "method must be one of"),
    ('name = "n"\ndescription = "d"\nmodel = "m"\n[spec.cpu]\nmethod = "ngram"\nmeasured = true\n',
     "needs 'speedup'"),
    ('name = "n"\ndescription = "d"\nmodel = "m"\n[spec.cpu]\nmethod = "ngram"\nspeedup = 2.0\n',
     "'speedup' given but measured = false"),
    ('name = "n"\ndescription = "d"\nmodel = "m"\n[spec.cpu]\nmethod = "ngram"\nbudget = 0\n', "budget must be >= 1"),
    ('name = "n"\ndescription = "d"\nmodel = "m"\n[spec.cpu\n', "not valid TOML"),
    ('name = "n"\ndescription = "d"\nmodel = "m"\n[spec.cpu]\nmethod = "mtp"\ntree = "bush"\n', "tree must be one of"),
    ('name = "n"\ndescription = "d"\nmodel = "m"\n[spec.cpu]\nmethod = "ngram"\ntree = "chain"\n',
     "for method mtp or dflash"),
])
def test_bad_files_name_the_problem(tmp_path, body, problem):
    f = tmp_path / "bad.toml"
    f.write_text(body)
    with pytest.raises(PresetError, match=problem):
        presets.load_file(f)


def test_the_cli_takes_the_tree_of_the_entry_auto_picked_unless_a_flag_names_one(tmp_path, monkeypatch):
    from server.cli import build_parser, engine_config

    preset = tmp_path / "mine.toml"
    preset.write_text('name = "mine"\ndescription = "d"\nmodel = "bundled:target"\n[spec.cpu]\nmethod = "mtp"\n'
                      'tree = "chain"\nmeasured = true\nspeedup = 1.2\ntokens_per_forward = 1.6\nsource = "a test"\n')
    monkeypatch.setattr(presets, "hardware_class", lambda: "cpu")
    parse = build_parser().parse_args
    spec = engine_config(parse(["run", "--config", str(preset), "-m", "x"])).config.spec
    assert (spec.method, spec.tree) == ("mtp", "chain")
    spec = engine_config(parse(["run", "--config", str(preset), "--spec-tree", "ddtree", "-m", "x"])).config.spec
    assert (spec.method, spec.tree) == ("mtp", "ddtree")
    # --spec named on the command line: the preset's tree is not consulted
    spec = engine_config(parse(["run", "--config", str(preset), "--spec", "dflash", "-m", "x"])).config.spec
    assert (spec.method, spec.tree) == ("dflash", "ddtree")
