"""Do the container image's pins agree with what its packages declare? The Dockerfile's `pip install`s and
setup.py's requirements (with the extras the Dockerfile installs) are the image's requirement set; each exactly
pinned package's declared requirements (Requires-Dist, recorded in tools/image_metadata/) are checked against
the other pins with `packaging`'s specifiers, for the image's Python 3.12 on Linux x86-64:

    python tools/image_pins.py            # offline: one line per conflict, exit 1 on any
    python tools/image_pins.py --fetch    # record the metadata of pins that have none (PyPI; after a pin bump)

A pin must satisfy every requirement on it that applies: those of the packages' installed extras and, for a
package the image pins itself (Transformer Engine), also those of extras it does not install: megatron-core
declares its Transformer Engine range only under its `dev` extra. (A package that only another pin brings,
such as vLLM's flashinfer, is that pin's business: megatron-core's dev extra wants another flashinfer.)

Why not pip's resolver: its metadata comes from the files (vLLM's wheel is 326 MB, torch's 527 MB; this index
serves no separate metadata), and transformer_engine_torch is a source distribution whose requirements are
computed when it is built against the installed torch and CUDA (Dynamic: requires-dist): pip would compile it.
The recorded files are those releases' own METADATA (PKG-INFO of an sdist), headers only.
"""

from __future__ import annotations

import argparse
import email.parser
import io
import re
import runpy
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
METADATA = ROOT / "tools" / "image_metadata"
# The image's interpreter and platform (Dockerfile: nvcr.io/nvidia/pytorch:25.12-py3, Python 3.12, x86-64)
ENVIRONMENT = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_machine": "x86_64",
               "platform_system": "Linux", "sys_platform": "linux", "os_name": "posix",
               "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def dockerfile_requirements(text: str) -> list[tuple[Requirement, str]]:
    """(requirement, where) of each quoted argument of the Dockerfile's `pip install`s; `-e ".[gpu]"` (this
    checkout) becomes setup.py's requirements with those extras."""
    found = []
    for command in re.findall(r"pip install\b[^\n]*", text):
        for spec in re.findall(r'"([^"]+)"', command):
            if spec.startswith("."):
                extras = re.findall(r"\w[\w-]*", spec[spec.find("["):]) if "[" in spec else []
                found += [(req, "setup.py") for req in setup_requirements(extras)]
            else:
                found.append((Requirement(spec), "Dockerfile"))
    return found


def setup_requirements(extras: list[str]) -> list[Requirement]:
    """setup.py's install_requires and the named extras, as setup.py itself computes them."""
    import setuptools

    captured, real = {}, setuptools.setup
    setuptools.setup = lambda **kwargs: captured.update(kwargs)
    try:
        runpy.run_path(str(ROOT / "setup.py"))
    finally:
        setuptools.setup = real
    specs = list(captured["install_requires"])
    for extra in extras:
        specs += captured["extras_require"][extra]
    return [Requirement(spec) for spec in specs]


def exact_version(req: Requirement) -> str | None:
    pins = [spec.version for spec in req.specifier if spec.operator in ("==", "===") and "*" not in spec.version]
    return pins[0] if len(pins) == 1 else None


def metadata_path(name: str, version: str, sdist: bool = False) -> Path:
    return METADATA / f"{canonicalize_name(name)}-{version}.{'PKG-INFO' if sdist else 'METADATA'}"


def read_metadata(name: str, version: str):
    """(headers, from an sdist) of name==version as recorded, or (None, False)."""
    for sdist in (False, True):
        path = metadata_path(name, version, sdist)
        if path.exists():
            return email.parser.HeaderParser().parsestr(path.read_text()), sdist
    return None, False


def _applies(req: Requirement, extra: str) -> bool:
    return req.marker is None or req.marker.evaluate({**ENVIRONMENT, "extra": extra})


def conflicts(text: str) -> tuple[list[str], list[str]]:
    """(conflicts, notes) of the image that the Dockerfile `text` builds. The pins whose own requirements are
    read: the image's (Dockerfile, setup.py), those their installed extras pin (Transformer Engine's core and
    torch packages), and a package that two of those constrain (torch: vLLM pins it, megatron-core and
    Transformer Engine bound it), where their versions can disagree; not the rest of vLLM's tree."""
    top = dockerfile_requirements(text)
    top_names = {canonicalize_name(req.name) for req, _ in top}
    pins: dict[str, tuple[str, str]] = {}  # name -> (version, "the pin as written (who)")
    declared: list[tuple[Requirement, str, bool]] = []  # (requirement, who declares it, of an installed extra)
    problems, notes, read = [], [], set()
    candidates = [(req, where, True) for req, where in top if _applies(req, "")]  # (req, who, read its metadata)
    declared += [(req, where, True) for req, where, _ in candidates]
    while candidates:
        req, where, expand = candidates.pop(0)
        name, version = canonicalize_name(req.name), exact_version(req)
        if version is None:
            continue
        pins.setdefault(name, (version, f"{req} ({where})"))
        constrained_by = {who for dep, who, installed in declared if installed and canonicalize_name(dep.name) == name}
        if name in read or not (expand or len(constrained_by) >= 2):
            continue
        read.add(name)
        version = pins[name][0]
        meta, sdist = read_metadata(name, version)
        if meta is None:
            problems.append(f"{name}=={version}: no recorded metadata (python tools/image_pins.py --fetch)")
            continue
        python = meta.get("Requires-Python")
        if python and ENVIRONMENT["python_full_version"] not in SpecifierSet(python):
            problems.append(f"{name}=={version} requires Python {python}, the image has {ENVIRONMENT['python_version']}")
        # an sdist may leave its requirements to its build (PEP 643); a wheel's are what it declares
        if sdist and "requires-dist" in {value.lower() for value in meta.get_all("Dynamic") or []}:
            notes.append(f"{name}=={version}: requirements computed at its build (an sdist), not checked")
            continue
        who = f"{name}=={version}"
        for line in meta.get_all("Requires-Dist") or []:
            dep = Requirement(line)
            if _applies(dep, ""):
                declared.append((dep, who, True))
                candidates.append((dep, who, False))
            elif any(_applies(dep, extra) for extra in req.extras):
                declared.append((dep, who, True))
                candidates.append((dep, who, True))
            elif dep.marker is not None and any(_applies(dep, extra) for extra in meta.get_all("Provides-Extra") or []):
                declared.append((dep, f"{who} (extra {str(dep.marker).split('extra == ')[-1]})", False))
        # a package seen before this one's requirements may now be constrained twice
        candidates += [(dep, who, False) for dep, who, installed in declared
                       if installed and canonicalize_name(dep.name) not in read and exact_version(dep)]
    for dep, who, installed in declared:
        name = canonicalize_name(dep.name)
        if name not in pins or not (installed or name in top_names):
            continue
        version, pinned = pins[name]
        if not dep.specifier.contains(Version(version), prereleases=True):
            problems.append(f"{pinned} conflicts with {who}, which declares {dep.name}{dep.specifier}")
    return problems, notes


# ------------------------------------------------------------------------------------------- fetch ----
class _HttpFile(io.RawIOBase):
    """A remote file read by HTTP ranges: zipfile reads a wheel's METADATA, not its hundreds of MB."""

    def __init__(self, url: str):
        import urllib.request

        self.url, self.pos, self.urllib = url, 0, urllib.request
        self.size = int(urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60)
                        .headers["Content-Length"])

    def seekable(self):
        return True

    def readable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=0):
        self.pos = (0, self.pos, self.size)[whence] + offset
        return self.pos

    def readinto(self, buffer):
        end = min(self.pos + len(buffer), self.size)
        if end <= self.pos:
            return 0
        request = self.urllib.Request(self.url, headers={"Range": f"bytes={self.pos}-{end - 1}"})
        data = self.urllib.urlopen(request, timeout=60).read()
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


def fetch(name: str, version: str) -> Path:
    """Record name==version's METADATA (headers only) from PyPI: a CPython 3.12 / Linux x86-64 or pure-Python
    wheel's, else the sdist's PKG-INFO."""
    import json
    import tarfile
    import urllib.request

    request = urllib.request.Request(f"https://pypi.org/simple/{canonicalize_name(name)}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    files = [f for f in json.load(urllib.request.urlopen(request, timeout=60))["files"]
             if re.match(rf"{re.escape(re.sub(r'[-_.]+', '_', name))}-{re.escape(version)}[-.]", f["filename"], re.I)]
    wheels = [f for f in files if f["filename"].endswith(".whl") and re.search(r"-(py3|cp312|cp38-abi3)-", f["filename"])
              and re.search(r"(none-any|manylinux\w*x86_64)\.whl$", f["filename"])]
    sdist = not wheels
    if wheels:
        archive = zipfile.ZipFile(io.BufferedReader(_HttpFile(wheels[0]["url"]), 1 << 16))
        text = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    else:
        sdist = next(f for f in files if f["filename"].endswith(".tar.gz"))
        with tarfile.open(fileobj=io.BytesIO(urllib.request.urlopen(sdist["url"], timeout=120).read())) as tar:
            text = tar.extractfile(next(m for m in tar.getmembers() if m.name.count("/") == 1
                                        and m.name.endswith("/PKG-INFO"))).read().decode()
    path = metadata_path(name, version, sdist)
    path.parent.mkdir(exist_ok=True)
    path.write_text(text.split("\n\n", 1)[0].rstrip("\n") + "\n")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fetch", action="store_true", help="record the metadata of pins that have none (PyPI)")
    parser.add_argument("--dockerfile", type=Path, default=ROOT / "Dockerfile")
    args = parser.parse_args()
    text = args.dockerfile.read_text()
    while args.fetch:
        missing = [line.split(":")[0] for line in conflicts(text)[0] if "no recorded metadata" in line]
        for pin in missing:
            print(f"recorded {fetch(*pin.split('=='))}")
        args.fetch = bool(missing)
    problems, notes = conflicts(text)
    for line in notes:
        print(f"note: {line}")
    for line in problems:
        print(f"conflict: {line}")
    print(f"image pins: {'agree' if not problems else f'{len(problems)} conflicts'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
