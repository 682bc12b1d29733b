"""config.json files exactly as they are published (fragsim/model_configs: the presets';
tests/fixtures/configs: others), read as transformers reads them: the defaults a file
leaves out are filled in, layer types derived, multimodal files read through their
text_config. Their sources are in the SOURCES.md beside them."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from fragsim.catalog import MODELS
from fragsim.cli import main
from fragsim.hfconfig import read_hf_config
from fragsim.presets import FILES, PUBLISHED

FIXTURES = Path(__file__).parent / "fixtures" / "configs"


def kinds(model):
    return Counter(layer.label() for layer in model.layer_specs)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_preset_is_its_published_file(name):
    path = FILES / f"{name}.json"
    raw = json.loads(path.read_text())
    assert "transformers_version" in raw          # the file as saved, not a trimmed copy
    from_file = read_hf_config(path, name=name)
    preset = MODELS[name]
    assert preset.layers == from_file.layers and preset.num_params == from_file.num_params
    assert preset.weight_bytes == from_file.weight_bytes
    assert preset.source.startswith("huggingface.co/" + PUBLISHED[name])


def test_gemma3_without_layer_types_or_pattern_gets_transformers_default():
    raw = json.loads((FILES / "gemma-3-27b.json").read_text())
    assert "layer_types" not in raw["text_config"] and "sliding_window_pattern" not in raw["text_config"]
    m = MODELS["gemma-3-27b"]
    assert kinds(m) == {"sliding 1024": 52, "full": 10}      # five sliding per full one
    assert [la.kind for la in m.layer_specs[:6]] == ["sliding"] * 5 + ["full"]


@pytest.mark.parametrize("no_rope", [None, [], "absent"])
def test_llama4_no_rope_layers_null_empty_or_absent(tmp_path, no_rope):
    raw = json.loads((FILES / "llama-4-scout.json").read_text())
    if no_rope == "absent":
        del raw["text_config"]["no_rope_layers"]
    else:
        raw["text_config"]["no_rope_layers"] = no_rope
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    m = read_hf_config(path)
    assert kinds(m) == {"chunked 8192": 36, "full": 12}      # every fourth layer NoPE, global
    assert m.layer_specs[3].kind == "full" and m.layer_specs[0].kind == "chunked"


def test_multimodal_text_config_missing_heads_gets_its_default():
    raw = json.loads((FIXTURES / "gemma-3-4b-it.json").read_text())
    assert "num_attention_heads" not in raw["text_config"]
    m = read_hf_config(FIXTURES / "gemma-3-4b-it.json")
    assert m.num_heads == 8 and m.num_kv_heads == 4 and m.head_dim == 256  # Gemma3TextConfig's
    assert kinds(m) == {"sliding 1024": 29, "full": 5}
    assert m.name == "gemma-3-4b-it"


def test_families_without_an_entry_of_their_own():
    phi = read_hf_config(FIXTURES / "phi-4.json")          # Phi3ForCausalLM
    assert phi.architecture == "Phi3ForCausalLM" and kinds(phi) == {"full": 40}
    assert (phi.num_kv_heads, phi.head_dim) == (10, 128)
    assert 14.6e9 < phi.num_params < 14.8e9                # published: 14.7B
    small = read_hf_config(FIXTURES / "llama-3.2-1b-instruct.json")
    assert small.num_params == 1_235_814_400                # the checkpoint's exact count
    moe = read_hf_config(FIXTURES / "qwen3-30b-a3b.json")
    assert kinds(moe) == {"full": 48} and 30.4e9 < moe.num_params < 30.6e9


def test_nemotron_h_56b_from_its_published_file():
    m = MODELS["nemotron-h-56b"]
    assert kinds(m)["full"] == 10 and m.num_layers == 64   # 54 Mamba-2 + 10 attention
    assert 56.0e9 < m.num_params < 56.6e9


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.json")) + sorted(FILES.glob("*.json")),
                         ids=lambda p: p.name)
def test_capacity_reads_every_published_file(path, capsys):
    assert main(["capacity", "--model", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kv_slots"] > 0 or report["kv_budget_bytes"] <= 0
