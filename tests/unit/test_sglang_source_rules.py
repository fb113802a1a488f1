"""The SGLang behaviours this project encodes where SGLang's module cannot import on a CPU, each held to
the line of SGLang 0.5.23's installed source that makes it so.

The tests that encode them (the contract test, the pool, the weight transports, the client) run against
the embedded server, which is held to the same rules; this test fails when the installed SGLang no
longer says what they encode, and prints where each line is. Skipped where sglang is not installed.
"""

import pytest

import sglang_source

pytestmark = pytest.mark.skipif(sglang_source.source_dir() is None, reason=sglang_source.SKIP)

RULES = [  # (file under sglang/, a line it holds, what this project builds on it)
    ("srt/model_loader/loader.py", "is_local = os.path.isdir(model_name_or_path)",
     "/update_weights_from_disk loads a local checkpoint only from a directory (a file goes to the hub)"),
    ("srt/model_loader/loader.py", "hf_weights_files += glob.glob(os.path.join(hf_folder, pattern))",
     "every *.safetensors in that directory is loaded: one directory per weight version"),
    ("srt/managers/tokenizer_manager.py", "self.served_model_name = model_path",
     "after a disk update /model_info reports the weights' directory as the model"),
    ("srt/managers/scheduler.py", "if recv_req.abort_all or req.rid.startswith(recv_req.rid):",
     "/abort_request aborts every rid that starts with the one given: piece rids never prefix each other"),
    ("srt/managers/scheduler.py", "if self.is_fully_idle(ignore_waiting=self._engine_paused):",
     "the cache is flushed only when no request runs: not under an in_place pause"),
    ("srt/managers/scheduler_components/weight_updater.py", '"Weights were updated, but the cache was not flushed because "',
     "an update asking for that flush then fails: updates under in_place send flush_cache false"),
    ("srt/managers/scheduler_components/weight_updater.py", 'message="update_weights_from_distributed must run between "',
     "a distributed update runs only inside /begin_weight_update ... /end_weight_update"),
    ("srt/managers/io_struct.py", "weight_version: Optional[str] = None",
     "weight_version is a string (pydantic does not turn an int into one)"),
    ("srt/utils/msgspec_utils.py", 'extra_behavior="ignore",', "keys a request model does not declare are ignored"),
    ("srt/environ.py", "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION = EnvBool(True)",
     "/health generates a token, so it gets no answer while paused: probe /model_info then"),
    ("srt/entrypoints/http_server.py", 'HEALTH_CHECK_TIMEOUT = int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", 20))',
     "the health generation gives up (503) after 20 s"),
    ("srt/sampling/sampling_batch_info.py", "if enable_deterministic",
     "sampling_seed reaches the sampler only with --enable-deterministic-inference"),
    ("srt/managers/tokenizer_manager.py", "_INCREMENTAL_STREAMING_META_INFO_KEYS = (",
     "with --incremental-streaming-output a chunk carries only its own per-token entries"),
    ("srt/managers/tokenizer_manager.py", "output_ids = [output_ids[-1]] if len(output_ids) > 0 else []",
     "a request aborted while waiting ends, streamed incrementally, with its last id once more"),
    ("srt/arg_groups/arg_utils.py", 'return "--" + name.replace("_", "-")', "a server flag is its field name with dashes"),
]


@pytest.mark.parametrize("path,line,why", RULES, ids=[f"{p}:{w[:40]}" for p, _, w in RULES])
def test_sglang_still_says_it(path, line, why):
    lines = (sglang_source.source_dir() / path).read_text().splitlines()
    found = [i + 1 for i, text in enumerate(lines) if line in text]
    assert found, f"sglang/{path} no longer holds {line!r}, on which this rests: {why}"
    print(f"sglang/{path}:{found[0]}: {why}")
