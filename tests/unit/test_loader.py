"""Model sources, architecture checks and a save/load round trip through transformers' files."""

from __future__ import annotations

import dataclasses
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

from shared.kv.cache import KVCache
from shared.model.config import ModelArch
from shared.model.loader import ModelSource, check_same_vocabulary, load_hf_config, load_model
from shared.model.runner import ForwardItem, ModelRunner
from shared.settings import default_draft_model, default_target_model

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def write(path: Path, text: str = "") -> Path:
    path.write_text(text)
    return path


# ---------------------------------------------------------------------- ModelSource.resolve


def test_folder_with_only_a_gguf_file(tmp_path: Path) -> None:
    write(tmp_path / "config.json", "{}")
    write(tmp_path / "x.gguf")
    source = ModelSource.resolve(str(tmp_path))
    assert source == ModelSource(str(tmp_path), "x.gguf")
    assert source.hf_kwargs == {"gguf_file": "x.gguf"}


def test_folder_with_several_gguf_files_picks_the_first_by_name(tmp_path: Path) -> None:
    write(tmp_path / "b.gguf")
    write(tmp_path / "a.gguf")
    assert ModelSource.resolve(str(tmp_path)).gguf_file == "a.gguf"


@pytest.mark.parametrize("weights", ["model.safetensors", "model-00001-of-00002.safetensors", "pytorch_model.bin"])
def test_folder_with_hf_weights_ignores_gguf(tmp_path: Path, weights: str) -> None:
    write(tmp_path / "config.json", "{}")
    write(tmp_path / weights)
    write(tmp_path / "x.gguf")  # HF weights win over a stray .gguf
    source = ModelSource.resolve(str(tmp_path))
    assert source == ModelSource(str(tmp_path), None)
    assert source.hf_kwargs == {}


def test_direct_gguf_file_path(tmp_path: Path) -> None:
    gguf = write(tmp_path / "model.Q4_0.gguf")
    assert ModelSource.resolve(str(gguf)) == ModelSource(str(tmp_path), "model.Q4_0.gguf")


def test_hub_id_is_passed_through() -> None:
    source = ModelSource.resolve(HUB_ID)
    assert source == ModelSource(HUB_ID, None)
    assert source.hf_kwargs == {}


@pytest.mark.parametrize("missing", ["./no-such-model-dir", "/no/such/model", "~/no-such-model-dir-xyz"])
def test_missing_local_path_raises(missing: str) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ModelSource.resolve(missing)


def test_default_target_resolves_to_its_gguf() -> None:
    source = ModelSource.resolve(default_target_model())
    assert source.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (Path(source.name_or_path) / source.gguf_file).is_file()


def test_gguf_folder_config_is_read_from_config_json(tmp_path: Path) -> None:
    """The folder's config.json is used as is; the (here empty, unparsable) .gguf file is not opened."""
    LlamaConfig(vocab_size=77, hidden_size=32, num_attention_heads=2, num_hidden_layers=1).save_pretrained(tmp_path)
    write(tmp_path / "x.gguf")
    config = load_hf_config(ModelSource.resolve(str(tmp_path)))
    assert config.model_type == "llama" and config.vocab_size == 77


# ---------------------------------------------------------------------- architecture checks


def test_default_models_architecture_and_shared_vocabulary() -> None:
    target = ModelArch.from_hf_config(load_hf_config(ModelSource.resolve(default_target_model())))
    draft = ModelArch.from_hf_config(load_hf_config(ModelSource.resolve(default_draft_model())))
    assert (target.num_layers, draft.num_layers) == (30, 4)
    for arch in (target, draft):
        assert (arch.vocab_size, arch.hidden_size, arch.num_heads, arch.num_kv_heads) == (49152, 576, 9, 3)
        assert arch.head_dim == 64 and arch.tie_word_embeddings and not arch.attention_bias
        assert arch.rope_parameters["rope_theta"] == 100000.0
        assert arch.rope_parameters["rope_type"] == "default"
    check_same_vocabulary(target, draft, "target", "draft")


def test_check_same_vocabulary_names_both_models() -> None:
    arch = ModelArch.from_hf_config(LlamaConfig(vocab_size=100, hidden_size=32, num_attention_heads=2))
    other = dataclasses.replace(arch, vocab_size=101)
    check_same_vocabulary(arch, dataclasses.replace(arch), "t", "d")  # same size: fine
    with pytest.raises(ValueError) as err:
        check_same_vocabulary(arch, other, "org/big-target", "org/small-draft")
    message = str(err.value)
    for part in ("org/big-target", "org/small-draft", "100", "101"):
        assert part in message


def test_non_llama_model_type_is_refused() -> None:
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not a Llama-family model; supported: llama"):
        ModelArch.from_hf_config(GPT2Config())


def test_non_silu_activation_is_refused() -> None:
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        ModelArch.from_hf_config(LlamaConfig(hidden_act="gelu"))


def test_arch_fields_from_config() -> None:
    cfg = Qwen2Config(vocab_size=50, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, eos_token_id=[3, 4])
    arch = ModelArch.from_hf_config(cfg)
    assert arch.attention_bias and arch.head_dim == 16 and arch.num_kv_heads == 2
    assert arch.q_size == 64 and arch.kv_size == 32 and arch.eos_token_ids == (3, 4)
    llama = ModelArch.from_hf_config(LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=32, eos_token_id=2))
    assert llama.head_dim == 32 and llama.q_size == 128 and llama.num_kv_heads == 4 and llama.eos_token_ids == (2,)


# ---------------------------------------------------------------------- save_pretrained -> load_model


def tiny_config(kind: str):
    common = dict(
        vocab_size=120,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    if kind == "llama-untied":
        return LlamaConfig(**common, tie_word_embeddings=False)
    return Qwen2Config(**common, tie_word_embeddings=True)


@pytest.mark.parametrize("kind", ["llama-untied", "qwen2-tied"])
def test_save_pretrained_round_trip(tmp_path: Path, kind: str) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only adds contention
    try:
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(tiny_config(kind)).eval()
        with torch.no_grad():  # non-trivial weights, biases and norms so that a wrong load shows
            for name, p in hf.named_parameters():
                p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
        hf.save_pretrained(tmp_path)
        assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] == (kind == "qwen2-tied")

        model, arch = load_model(str(tmp_path))
        assert arch == ModelArch.from_hf_config(hf.config)
        tokens = torch.randint(0, arch.vocab_size, (19,), generator=torch.Generator().manual_seed(1)).tolist()
        cache = KVCache(arch.num_layers, 8, 4, arch.num_kv_heads, arch.head_dim)
        runner = ModelRunner(model, cache, attention_backend="torch")
        (logits,) = runner.forward([ForwardItem([5, 2, 7, 0, 3], 0, tokens, len(tokens))])
        with torch.no_grad():
            expected = hf(torch.tensor([tokens])).logits[0]
        assert expected.std() > 1.0
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)
    finally:
        torch.set_num_threads(threads)


def test_sliding_window_models_refuse_longer_contexts():
    from transformers import MistralConfig, Qwen2Config

    from shared.model.config import ModelArch

    mistral = ModelArch.from_hf_config(MistralConfig(sliding_window=256, max_position_embeddings=1024))
    mistral.check_context_length(256)
    with pytest.raises(ValueError, match="sliding-window attention"):
        mistral.check_context_length(257)
    qwen = ModelArch.from_hf_config(Qwen2Config(sliding_window=256, use_sliding_window=False))
    assert qwen.sliding_window is None
    qwen.check_context_length(100_000)


# ---------------------------------------------------------------------- the de-quantised GGUF cache


@pytest.fixture
def counted_conversions(tmp_path: Path, monkeypatch) -> tuple[ModelSource, list[str]]:
    """A GGUF folder whose conversion (transformers' de-quantisation) is a slow stand-in that counts its calls."""
    from shared.model import loader

    write(tmp_path / "m.gguf")
    conversions: list[str] = []

    def convert(path: str) -> torch.nn.Module:
        conversions.append(path)
        time.sleep(0.5)  # long enough for every loader below to be waiting at once
        torch.manual_seed(0)
        return torch.nn.Linear(4, 3)

    monkeypatch.setattr(loader, "load_hf_model", convert)
    return ModelSource.resolve(str(tmp_path)), conversions


def test_loaders_starting_together_on_a_cold_cache_de_quantise_once(tmp_path, monkeypatch, counted_conversions):
    from shared.model.loader import load_state_dict

    source, conversions = counted_conversions
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    with ThreadPoolExecutor(4) as pool:  # flock: separate opens conflict, within one process as across several
        states = list(pool.map(lambda _: load_state_dict(source), range(4)))
    assert len(conversions) == 1
    assert all(s.keys() == {"weight", "bias"} and torch.equal(s["weight"], states[0]["weight"]) for s in states)
    assert load_state_dict(source).keys() == {"weight", "bias"} and len(conversions) == 1  # later: the file


def test_an_unwritable_cache_converts_every_time_and_still_loads(tmp_path, monkeypatch, counted_conversions):
    from shared.model.loader import load_state_dict

    source, conversions = counted_conversions
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(write(tmp_path / "a-file") / "cache"))  # mkdir fails under a file
    assert load_state_dict(source).keys() == {"weight", "bias"}
    assert load_state_dict(source).keys() == {"weight", "bias"}
    assert len(conversions) == 2
