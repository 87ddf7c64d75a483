"""Builds the rnnd package: the modules under rnnd/ plus rnnd/v1/, the gRPC stubs of rnnd.v1 and
grpc.health.v1, generated here from the protos and never committed.

The stubs come from Debian's protoc (protobuf-compiler) and grpc_python_plugin
(protobuf-compiler-grpc); the health proto from grpc-proto (/usr/share/grpc-proto). The rnnd proto
is the repository's proto/rnnd/v1/rnnd.proto, two directories up. Both are generated under
rnnd/v1/, so that no top-level `grpc` package shadows the real grpcio module. CMake's build runs
this same step (client/python/CMakeLists.txt): `setup.py build_py --build-lib DIR`.
Overrides: RNND_PROTOC, RNND_GRPC_PYTHON_PLUGIN, RNND_PROTO_DIR, RNND_HEALTH_PROTO_ROOT.
"""

import os
import re
import shutil
import subprocess
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
NEEDS = "Debian: apt-get install protobuf-compiler protobuf-compiler-grpc grpc-proto"


def need(path, what, env):
    if not path or not os.path.isfile(path):
        raise SystemExit("rnnd: cannot generate the gRPC stubs: %s not found (%s; or set %s)"
                         % (what, NEEDS, env))
    return path


def generate_stubs(out_dir):
    """Writes OUT_DIR/rnnd/v1/{__init__,rnnd_pb2,rnnd_pb2_grpc,health_pb2,health_pb2_grpc}.py."""
    env = os.environ.get
    protoc = need(env("RNND_PROTOC") or shutil.which("protoc"), "protoc", "RNND_PROTOC")
    plugin = need(env("RNND_GRPC_PYTHON_PLUGIN") or shutil.which("grpc_python_plugin"),
                  "grpc_python_plugin", "RNND_GRPC_PYTHON_PLUGIN")
    rnnd_proto = need(os.path.join(env("RNND_PROTO_DIR") or os.path.join(HERE, "..", "..", "proto"),
                                   "rnnd", "v1", "rnnd.proto"),
                      "rnnd/v1/rnnd.proto (the repository's proto/)", "RNND_PROTO_DIR")
    health_proto = need(os.path.join(env("RNND_HEALTH_PROTO_ROOT") or "/usr/share/grpc-proto",
                                     "grpc", "health", "v1", "health.proto"),
                        "grpc/health/v1/health.proto", "RNND_HEALTH_PROTO_ROOT")
    with tempfile.TemporaryDirectory(prefix="rnnd-proto-") as src:
        os.makedirs(os.path.join(src, "rnnd", "v1"))
        shutil.copy(rnnd_proto, os.path.join(src, "rnnd", "v1", "rnnd.proto"))
        shutil.copy(health_proto, os.path.join(src, "rnnd", "v1", "health.proto"))
        os.makedirs(os.path.join(out_dir, "rnnd", "v1"), exist_ok=True)
        subprocess.run([protoc, "-I" + src, "--python_out=" + out_dir,
                        "--grpc_python_out=" + out_dir, "--plugin=protoc-gen-grpc_python=" + plugin,
                        "rnnd/v1/rnnd.proto", "rnnd/v1/health.proto"], check=True)
    open(os.path.join(out_dir, "rnnd", "v1", "__init__.py"), "w").close()


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        generate_stubs(self.build_lib)


def version():
    with open(os.path.join(HERE, "rnnd", "__init__.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M).group(1)


with open(os.path.join(HERE, "README.md")) as f:
    readme = f.read()

# No package data: it would make build_py run egg_info inside the source tree.
setup(
    name="rnnd",
    version=version(),
    description="Python and PyTorch client of rnnd (recurrent RL policies served over gRPC)",
    long_description=readme,
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    install_requires=["grpcio", "protobuf", "numpy"],
    extras_require={"torch": ["torch"]},
    packages=["rnnd"],
    include_package_data=False,
    cmdclass={"build_py": BuildPyWithStubs},
)
