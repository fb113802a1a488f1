"""A model's own weights as a weight-version directory, the way `/update_weights_from_disk` takes them.

    path = save_weights_dir(model, tmp_path / "v1")   # tmp_path/v1/model.safetensors; returns "tmp_path/v1"

SGLang loads a checkpoint directory (every *.safetensors in it), never a file, and the
embedded server is held to the same rule; tests that reload a server's own weights as a
"new" version (so sequences continue exactly) write them here.
"""

from pathlib import Path

from safetensors.torch import save_file


def save_weights_dir(model, path: Path) -> str:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
              str(path / "model.safetensors"))
    return str(path)
