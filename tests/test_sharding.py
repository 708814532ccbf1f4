"""jaxformer.sharding on 8 simulated CPU devices.

JAX fixes its device count when it starts, so the cases in `sharding/eight_devices.py` run
in a subprocess started with `--xla_force_host_platform_device_count=8`; the rest of the
suite keeps its single device.
"""

import os
import subprocess
import sys
from pathlib import Path

CASES = Path(__file__).parent / "sharding" / "eight_devices.py"


def test_sharding_cases_on_eight_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout
