"""Disk weight publishing: a published version (its own directory, as SGLang loads it) loads into a
fresh model with identical outputs, tied weights are stored once, old versions are pruned as whole
directories, and the file of a version being pruned is taken over by the next one only when nobody
is reading it."""

import glob
import os

import pytest
import torch
from safetensors.torch import load_file, load_model

from async_rl.config import ModelConfig
from async_rl.models import build_tiny_tokenizer, load_model as load_async_rl_model
from async_rl.protocols import WeightPublisher
from async_rl.weight_sync.disk import DiskWeightPublisher, load_weights, weights_version
from async_rl.weight_sync.staging import map_weights

ALPHABET = "0123456789+= "


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(ALPHABET)


def _model(tok, seed):
    return load_async_rl_model(ModelConfig(dtype="float32", tiny_alphabet=ALPHABET), seed=seed, tokenizer=tok)


def _file(version_dir):
    return os.path.join(version_dir, "model.safetensors")


def _logits(model):
    ids = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def _perturbed(tok):
    """A model whose weights differ from any freshly built one (as after training)."""
    model = _model(tok, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model


def test_publish_then_load_into_a_fresh_model_gives_identical_outputs(tok, tmp_path):
    torch.manual_seed(0)
    trained = _perturbed(tok)
    publisher: WeightPublisher = DiskWeightPublisher(str(tmp_path / "w"))
    msg = publisher.publish(trained.state_dict(), 3)
    assert msg == {"kind": "weights", "version": 3, "path": str(tmp_path / "w" / "v000003")}
    assert os.path.isabs(msg["path"]) and weights_version(msg["path"]) == 3
    # what SGLang loads from the path: a local checkpoint only if it is a directory, then every *.safetensors
    # in it (sglang/srt/model_loader/loader.py, DefaultModelLoader._prepare_weights: os.path.isdir, glob)
    assert os.path.isdir(msg["path"])
    assert glob.glob(os.path.join(msg["path"], "*.safetensors")) == [os.path.join(msg["path"], "model.safetensors")]

    fresh = _model(tok, seed=1)
    assert not torch.allclose(_logits(fresh), _logits(trained))
    fresh.load_state_dict(load_weights(msg["path"]), strict=True)
    assert torch.equal(_logits(fresh), _logits(trained))
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()  # still tied

    other = _model(tok, seed=2)  # a reader that knows nothing of our metadata (safetensors' own loader)
    load_model(other, _file(msg["path"]), strict=True)
    assert torch.equal(_logits(other), _logits(trained))


def test_tied_weights_are_stored_once(tok, tmp_path):
    model = _model(tok, seed=0)
    path = DiskWeightPublisher(tmp_path).publish(model.state_dict(), 0)["path"]
    raw = load_file(os.path.join(path, "model.safetensors"))
    assert "model.embed_tokens.weight" in raw and "lm_head.weight" not in raw
    full = load_weights(path)
    assert set(full) == set(model.state_dict())
    assert full["lm_head.weight"] is full["model.embed_tokens.weight"]


def test_views_sharing_storage_and_non_contiguous_tensors(tmp_path):
    base = torch.arange(12.0)
    state = {"a": base[:6], "b": base[6:], "c": torch.arange(6.0).reshape(2, 3).t(), "d": base}
    path = DiskWeightPublisher(tmp_path).publish(state, 1)["path"]
    back = load_weights(path)
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_keep_last_prunes_older_versions(tmp_path):
    publisher = DiskWeightPublisher(tmp_path, keep_last=2)
    for v in range(1, 6):
        publisher.publish({"w": torch.full((3,), float(v))}, v)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["v000004", "v000005"]  # whole version directories: SGLang loads every file in one
    assert os.listdir(tmp_path / "v000005") == ["model.safetensors"]
    assert torch.equal(load_weights(tmp_path / names[-1])["w"], torch.full((3,), 5.0))
    with pytest.raises(ValueError, match="keep_last"):
        DiskWeightPublisher(tmp_path, keep_last=0)
    with pytest.raises(FileNotFoundError, match="pruned"):
        load_weights(tmp_path / "v000001")



def test_the_pruned_versions_file_is_taken_over_unless_someone_is_reading_it(tmp_path):
    """Writing into the page cache of the file about to be pruned is cheap; a reader must never see it change."""
    publisher = DiskWeightPublisher(tmp_path, keep_last=2)
    paths = {v: publisher.publish({"w": torch.full((1000,), float(v))}, v)["path"] for v in (1, 2)}
    inode = {v: os.stat(_file(p)).st_ino for v, p in paths.items()}
    reading = map_weights(paths[1])  # a server loading v1 holds a shared lock through its memory map
    p3 = publisher.publish({"w": torch.full((1000,), 3.0)}, 3)["path"]
    assert os.stat(_file(p3)).st_ino != inode[1] and not os.path.exists(paths[1])  # a new file; v1 pruned as before
    assert torch.equal(reading["w"], torch.full((1000,), 1.0))  # the reader's bytes did not change
    del reading
    p4 = publisher.publish({"w": torch.full((1000,), 4.0)}, 4)["path"]
    assert os.stat(_file(p4)).st_ino == inode[2]  # nobody reads v2: its file became v4's
    assert torch.equal(load_weights(p4)["w"], torch.full((1000,), 4.0)) and weights_version(p4) == 4
    p5 = publisher.publish({"w": torch.full((10,), 5.0), "b": torch.ones(2, dtype=torch.int64)}, 5)["path"]
    assert torch.equal(load_weights(p5)["w"], torch.full((10,), 5.0))  # a smaller version in a larger file
    assert os.path.getsize(_file(p5)) < os.path.getsize(_file(p4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000004", "v000005"]


def test_a_version_published_again_is_swapped_in_its_directory(tmp_path):
    """A trainer resumed from a checkpoint publishes the versions after it again, and a trainer publishes
    its current version again for a rollout side that joins, while servers may be loading it: the
    directory stays (a random-kill run lost its rollout side when it briefly did not), its file is
    replaced in one rename."""
    publisher = DiskWeightPublisher(tmp_path, keep_last=2)
    first = publisher.publish({"w": torch.full((3,), 1.0)}, 3)["path"]
    directory, file = os.stat(first).st_ino, os.stat(_file(first)).st_ino
    again = publisher.publish({"w": torch.full((3,), 2.0)}, 3)["path"]
    assert again == first and torch.equal(load_weights(again)["w"], torch.full((3,), 2.0))
    assert os.stat(again).st_ino == directory and os.stat(_file(again)).st_ino != file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000003"]  # no partial or replaced leftovers
    assert os.listdir(again) == ["model.safetensors"]


@pytest.mark.parametrize("servers,taken_over", [(["engine.backend=embedded"], True),
                                                (["engine.backend=sglang"], False),
                                                (["rollout.server_addrs=[http://gpu:30000]"], False)])
def test_a_pruned_file_is_written_over_only_where_every_server_locks_what_it_loads(tmp_path, servers, taken_over):
    """SGLang maps weight files without the embedded engine's read lock (safetensors safe_open in
    sglang/srt/model_loader/weight_utils.py): a file it may still be loading must never change under it."""
    from async_rl.config import load_config
    from async_rl.weight_sync.publishers import build_publisher

    cfg = load_config(None, [f"run_dir={tmp_path}", "weight_sync.transport=disk", "weight_sync.keep_last=2",
                             "mode=sync", *servers])
    publisher = build_publisher(cfg, lambda *a, **k: None)
    paths = {v: publisher.publish({"w": torch.full((100,), float(v))}, v)["path"] for v in (1, 2)}
    first = os.stat(_file(paths[1])).st_ino
    p3 = publisher.publish({"w": torch.full((100,), 3.0)}, 3)["path"]
    assert (os.stat(_file(p3)).st_ino == first) == taken_over
