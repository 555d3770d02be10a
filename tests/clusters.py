"""The CPU cluster file the tests plan and price with.

``configs/local-cpu.yaml`` describes whichever machine last ran ``autoddl calibrate`` (each session's VM
may be another: one without bfloat16 matmuls gets no bfloat16 peak). The tests read a frozen copy of one
such calibration instead, so that what they assert does not depend on the machine that calibrated last.
"""

from pathlib import Path

CPU_CLUSTER_PATH = Path(__file__).resolve().parent / "data" / "local-cpu.yaml"
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def cluster_path(name: str) -> Path:
    """A cluster file by name: the frozen CPU file for ``local-cpu``, else ``configs/<name>.yaml``."""
    return CPU_CLUSTER_PATH if name == "local-cpu" else CONFIG_DIR / f"{name}.yaml"
