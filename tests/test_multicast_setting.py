"""NVLink multicast off for multi-rank launches unless HYBRIDLM_NVLS=1: benchmarks/common.sh's launcher helper, run in
bash with a stand-in interpreter that prints the environment and arguments it was started with, and
hybridlm.engine.init_distributed's defaults for ranks launched without the scripts."""
import json
import subprocess
import sys

import pytest

from conftest import REPO, subprocess_env
from hybridlm.config.errors import ConfigError
from hybridlm.engine.distributed import MULTICAST_OFF, multicast_setting

VARS = tuple(MULTICAST_OFF)

# prints what the launcher would have been started with: its arguments and the variables that matter here
FAKE_PYTHON = """#!{python}
import json, os, sys
keys = {keys!r} + ("CUDA_VISIBLE_DEVICES", "HYBRIDLM_NVLS")
print(json.dumps({{"argv": sys.argv[1:], "env": {{k: os.environ[k] for k in keys if k in os.environ}}}}))
"""


def launch_with(tmp_path, n, visible=("0", "1", "2", "3"), **env):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable, keys=VARS))
    fake.chmod(0o755)
    script = (f'source benchmarks/common.sh; PY={fake}; GPUS=({" ".join(visible)}); '
              f'launch {n} pretrain.py --config configs/experiments/gdn_300m.yaml')
    clean = {k: v for k, v in subprocess_env().items() if k not in (*VARS, "HYBRIDLM_NVLS", "CUDA_VISIBLE_DEVICES")}
    clean.update(env)
    return subprocess.run(["bash", "-c", script], cwd=REPO, env=clean, capture_output=True, text=True, timeout=60)


def launched(proc):
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_launcher_starts_the_ranks_with_multicast_off_by_default(tmp_path):
    got = launched(launch_with(tmp_path, 2))
    assert got["env"] == {**MULTICAST_OFF, "CUDA_VISIBLE_DEVICES": "0,1"}
    assert got["argv"] == ["-m", "deepspeed.launcher.runner", "--master_port", "29500", "--no_local_rank",
                           "pretrain.py", "--config", "configs/experiments/gdn_300m.yaml"]


def test_hybridlm_nvls_1_leaves_the_libraries_defaults(tmp_path):
    got = launched(launch_with(tmp_path, 4, HYBRIDLM_NVLS="1"))
    assert got["env"] == {"HYBRIDLM_NVLS": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}


def test_a_variable_the_user_set_keeps_its_value(tmp_path):
    got = launched(launch_with(tmp_path, 2, NCCL_NVLS_ENABLE="1", NVSHMEM_DISABLE_NVLS=""))
    assert got["env"] == {"NCCL_NVLS_ENABLE": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                          "NVSHMEM_DISABLE_NVLS": "", "CUDA_VISIBLE_DEVICES": "0,1"}


@pytest.mark.parametrize("n,env,message", [
    (2, {"HYBRIDLM_NVLS": "yes"}, "error: HYBRIDLM_NVLS=yes: expected 0 (multicast off, the default) or 1"),
    (8, {}, "error: NGPU=8, but only 4 GPUs are visible (CUDA_VISIBLE_DEVICES)"),
])
def test_bad_settings_are_one_line_and_launch_nothing(tmp_path, n, env, message):
    proc = launch_with(tmp_path, n, **env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(message)


def test_ranks_launched_without_the_scripts_get_the_same_defaults():
    env = {}
    assert multicast_setting(env) == MULTICAST_OFF and env == MULTICAST_OFF
    env = {"NCCL_NVLS_ENABLE": "1"}
    assert multicast_setting(env) == {k: v for k, v in MULTICAST_OFF.items() if k != "NCCL_NVLS_ENABLE"}
    assert env["NCCL_NVLS_ENABLE"] == "1"
    env = {"HYBRIDLM_NVLS": "1"}
    assert multicast_setting(env) == {} and env == {"HYBRIDLM_NVLS": "1"}
    with pytest.raises(ConfigError, match="HYBRIDLM_NVLS=2: expected 0"):
        multicast_setting({"HYBRIDLM_NVLS": "2"})
