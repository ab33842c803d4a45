"""A checkpoint's policy exported as a plain Hugging Face model (`rlhf_trainer.state.export`).

First, in seconds, checkpoints written here the way ZeRO-3 ranks write them (`test_reshard`'s
`write_state`): the directory, its tokenizer and generation config, the errors. Then runs of the
tiny GRPO example on a local Ray, one step with 2 ranks and one with 1 (`test_reshard`'s
`train`): the export loads with plain transformers and scores tokens as the trainer's policy
does, and the two exports hold the same model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from rlhf_local.tiny_models import CHAT_TEMPLATE, save_tiny_tokenizer  # noqa: E402
from rlhf_trainer.algo.batch import Batch  # noqa: E402
from rlhf_trainer.modeling.networks import build_causal_lm, hf_config  # noqa: E402
from rlhf_trainer.ranks.actors import next_token_scores  # noqa: E402
from rlhf_trainer.state import export  # noqa: E402
from rlhf_trainer.state.reshard import MASTER, shard_file, whole_tensors  # noqa: E402
from rlhfjob.config import load_job  # noqa: E402
from trainer.test_reshard import (  # noqa: E402, F401  (local_ray: a fixture used here)
    EXAMPLES,
    WEIGHT_TOLERANCE,
    local_ray,
    train,
    write_state,
)

SPEC = load_job(EXAMPLES / "grpo-tiny-cpu.yaml").spec
SEED = 3


def trainer_network(weights: dict[str, Any]) -> Any:
    """The policy's network as a trainer rank builds it, holding `weights` (tied ones once)."""
    network = build_causal_lm(SPEC.model, SEED, torch.float32)
    assert set(weights) == set(dict(network.named_parameters()))
    network.load_state_dict(weights, strict=False)
    return network.eval()


def trainer_logprobs(network: Any, input_ids: Any) -> Any:
    """Next-token log-probs as the policy computes them (`actors.next_token_scores`)."""
    ones = torch.ones_like(input_ids)
    micro = Batch(input_ids, ones, ones[:, 1:])
    with torch.no_grad():
        logprobs, _ = next_token_scores(network, micro, 1.0, SPEC.model)
    return logprobs


def exported_logprobs(directory: Path, input_ids: Any) -> Any:
    """Next-token log-probs of the exported model, with transformers and torch alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logprobs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def sequences(rows: int = 4, length: int = 12) -> Any:
    return torch.randint(1, 32, (rows, length), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The policy's Hugging Face directory: the example's config, a tiny real tokenizer."""
    directory = save_tiny_tokenizer(tmp_path_factory.mktemp("policy-model"))
    assert SPEC.model.random_init is not None
    hf_config(SPEC.model.random_init).save_pretrained(directory)
    return directory


@pytest.fixture()
def weights() -> dict[str, Any]:
    network = build_causal_lm(SPEC.model, SEED, torch.float32)
    return {name: param.detach().clone() for name, param in network.named_parameters()}


@pytest.fixture()
def role(tmp_path: Path, weights: dict[str, Any]) -> Path:
    """A policy directory as two ZeRO-3 ranks write it."""
    write_state(tmp_path / "policy", weights, world_size=2)
    return tmp_path / "policy"


# --------------------------------------------------------------------------------------------
# Written here (seconds)


def test_the_export_is_a_model_with_its_tokenizer_and_generation_config(
    tmp_path: Path, role: Path, model_dir: Path, weights: dict[str, Any]
) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    out = export.export_checkpoint(role, tmp_path / "out", model_dir=model_dir)
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    ids = sequences()
    got = exported_logprobs(out, ids)
    torch.testing.assert_close(got, trainer_logprobs(trainer_network(weights), ids))
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.eos_token == "<eos>"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert prompt == "<|user|>hi"
    generation = GenerationConfig.from_pretrained(out)
    assert generation.eos_token_id == tokenizer.eos_token_id
    assert generation.pad_token_id == tokenizer.pad_token_id
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert not list(tmp_path.glob(".out.*")), "no staging directory left behind"


def test_the_dtype_is_the_one_asked_else_the_configs(
    tmp_path: Path, role: Path, model_dir: Path, weights: dict[str, Any]
) -> None:
    from safetensors.torch import load_file

    out = export.export_checkpoint(role, tmp_path / "bf16", model_dir=model_dir, dtype="bfloat16")
    tensors = load_file(out / "model.safetensors")
    assert {tensor.dtype for tensor in tensors.values()} == {torch.bfloat16}
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(tensors[name], weights[name].to(torch.bfloat16))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # No dtype asked, none in the config: float32, the saved weights bit for bit.
    out = export.export_checkpoint(role, tmp_path / "fp32", model_dir=model_dir)
    tensors = load_file(out / "model.safetensors")
    assert set(tensors) == set(weights)  # the tied head is the embedding, saved once
    assert all(torch.equal(tensors[name], tensor) for name, tensor in weights.items())


def test_the_same_weights_saved_by_one_two_or_three_ranks_export_alike(
    tmp_path: Path, model_dir: Path, weights: dict[str, Any]
) -> None:
    exports = []
    for ranks in (1, 2, 3):
        write_state(tmp_path / f"policy-{ranks}", weights, world_size=ranks)
        exports.append(
            export.export_checkpoint(
                tmp_path / f"policy-{ranks}", tmp_path / f"out-{ranks}", model_dir=model_dir
            )
        )
    for out in exports[1:]:
        assert_same_model(out, exports[0], tolerance=0.0)


def test_a_checkpoint_with_its_model_files_needs_no_model_dir(
    tmp_path: Path, role: Path, model_dir: Path, weights: dict[str, Any]
) -> None:
    """What the trainer writes into each checkpoint's policy directory (`save_model_files`):
    the job's config and dtype, its named tokenizer."""
    from transformers import AutoTokenizer

    spec = SPEC.model.model_copy(update={"dtype": "bfloat16", "tokenizer": str(model_dir)})
    export.save_model_files(spec, role / export.MODEL_FILES_DIR)
    out = export.export_checkpoint(role, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16", "the job's dtype is the default"
    assert AutoTokenizer.from_pretrained(out).chat_template == CHAT_TEMPLATE
    # A token-id job has no tokenizer: the model alone.
    shutil.rmtree(role / export.MODEL_FILES_DIR)
    export.save_model_files(SPEC.model, role / export.MODEL_FILES_DIR)
    out = export.export_checkpoint(role, tmp_path / "token-ids")
    assert not (out / "tokenizer_config.json").exists()
    ids = sequences()
    torch.testing.assert_close(
        exported_logprobs(out, ids), trainer_logprobs(trainer_network(weights), ids)
    )


def test_model_files_that_cannot_be_read_cost_only_themselves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tokenizer the rank cannot load must not fail the checkpoint it writes into."""
    spec = SPEC.model.model_copy(update={"tokenizer": str(tmp_path / "gone")})
    export.save_model_files(spec, tmp_path / "hf")
    assert not (tmp_path / "hf" / "config.json").exists()
    assert "export will need --model-dir" in caplog.text


def drop_part(role: Path, rank: int, name: str) -> None:
    """Rewrite rank `rank`'s master weights without its part of parameter `name`."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = role / shard_file(MASTER, rank)
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata())
        tensors = {key: handle.get_tensor(key) for key in handle.keys() if key != name}  # noqa: SIM118
    metadata["parts"] = json.dumps(
        {key: value for key, value in json.loads(metadata["parts"]).items() if key != name}
    )
    save_file(tensors, str(path), metadata=metadata)


def test_parts_that_do_not_cover_a_parameter_fail_naming_it(
    tmp_path: Path, role: Path, model_dir: Path
) -> None:
    name = "model.layers.1.self_attn.k_proj.weight"
    drop_part(role, 1, name)
    with pytest.raises(export.ExportError, match=rf"parameter '{name}'.*cover elements up to"):
        export.export_checkpoint(role, tmp_path / "out", model_dir=model_dir)
    assert not (tmp_path / "out").exists()
    assert export.main([str(role), str(tmp_path / "out"), "--model-dir", str(model_dir)]) == 1


def test_parameters_the_model_does_not_have_are_refused(
    tmp_path: Path, model_dir: Path, weights: dict[str, Any]
) -> None:
    """A wrapper's prefix (``module.``) would load nothing: refused, naming the names."""
    write_state(tmp_path / "policy", {f"module.{k}": v for k, v in weights.items()}, 2)
    with pytest.raises(
        export.ExportError,
        match=r"missing \['model\.embed_tokens\.weight'.*unexpected \['module\.model\.",
    ):
        export.export_checkpoint(tmp_path / "policy", tmp_path / "out", model_dir=model_dir)


def test_without_a_config_the_error_says_what_to_pass(tmp_path: Path, role: Path) -> None:
    with pytest.raises(export.ExportError, match=r"no model config .*--model-dir"):
        export.export_checkpoint(role, tmp_path / "out")
    with pytest.raises(export.ExportError, match=r"no config\.json"):
        export.export_checkpoint(role, tmp_path / "out", model_dir=tmp_path / "nothing")
    with pytest.raises(export.ExportError, match="not a checkpoint"):
        export.export_checkpoint(tmp_path, tmp_path / "out", model_dir=tmp_path)


def test_a_non_empty_output_is_kept_unless_overwrite(
    tmp_path: Path, role: Path, model_dir: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(export.ExportError, match="exists and is not empty"):
        export.export_checkpoint(role, out, model_dir=model_dir)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    argv = [str(role), str(out), "--model-dir", str(model_dir)]
    assert export.main(argv) == 1
    assert export.main([*argv, "--overwrite", "--dtype", "float16"]) == 0
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export.export_checkpoint(role, empty, model_dir=model_dir) == empty
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "out", "policy"]


# --------------------------------------------------------------------------------------------
# Trained by the real trainer on a local Ray (slow)


@pytest.fixture(scope="module")
def trained(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[int, Any]:
    """The store of one GRPO step trained by 2 ranks (`test_reshard` exports the same step
    trained by 2 ranks and by 1, from the runs it trains anyway)."""
    request.getfixturevalue("local_ray")
    root = tmp_path_factory.mktemp("trained")
    return {2: train("grpo", root / "ranks-2", ranks=2, steps=1)[1]}


@pytest.mark.slow
def test_the_export_of_a_trained_checkpoint_scores_tokens_as_the_trainer(
    trained: dict[int, Any], tmp_path: Path, model_dir: Path
) -> None:
    store = trained[2]
    checkpoint = store.step_dir(1)
    out = export.export_checkpoint(checkpoint, tmp_path / "model", model_dir=model_dir)
    ids = sequences()
    network = trainer_network(whole_tensors(checkpoint / export.POLICY_DIR))
    got, want = exported_logprobs(out, ids), trainer_logprobs(network, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    untrained = trainer_logprobs(build_causal_lm(SPEC.model, SEED, torch.float32), ids)
    assert not torch.allclose(got, untrained, atol=1e-5), "the trained weights, not the initial"
    # A run directory stands for its newest complete checkpoint.
    latest = export.export_checkpoint(store.root, tmp_path / "latest", model_dir=model_dir)
    assert_same_model(latest, out, tolerance=0.0)
    # A checkpoint's files are verified against its manifest.
    copy = shutil.copytree(checkpoint, tmp_path / checkpoint.name)
    part = copy / export.POLICY_DIR / shard_file(MASTER, 1)
    part.write_bytes(part.read_bytes()[:-1] + b"\0")
    with pytest.raises(export.ExportError, match=r"hash mismatch|bytes"):
        export.export_checkpoint(copy, tmp_path / "tampered", model_dir=model_dir)


def assert_same_model(got: Path, want: Path, tolerance: float) -> None:
    from safetensors.torch import load_file

    got_tensors = load_file(got / "model.safetensors")
    want_tensors = load_file(want / "model.safetensors")
    assert got_tensors.keys() == want_tensors.keys()
    for name, tensor in want_tensors.items():
        assert got_tensors[name].dtype == tensor.dtype, name
        torch.testing.assert_close(got_tensors[name], tensor, rtol=0, atol=tolerance, msg=name)
    assert json.loads((got / "config.json").read_text()) == json.loads(
        (want / "config.json").read_text()
    )
