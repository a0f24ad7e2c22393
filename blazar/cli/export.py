"""`blazar export kubernetes -f DIR [-o FILE]`: the fleet's manifests as Kubernetes
objects (`blazar.export.kubernetes` translates; this module reads and writes).

Manifests are read and validated as `apply -f` reads them (the same loader, the same
schema and reference checks, the same errors), but against the files alone: there is
no daemon to ask, and the model roots of this host (`serve --model-root`) do not bind
a cluster. Each served Model's GGUF header is read when the file is on this host (a
`path` source, or a `package` one that a daemon here has assembled into the model
cache; nothing is assembled or downloaded) for the memory request.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from blazar.api import errors, manifests
from blazar.api.kinds import Model
from blazar.controller import fit, modelcache, modelfile
from blazar.controller.sources import ModelSources, SourceError
from blazar.export import kubernetes

# What kubectl users give `-o`: formats, which `export`'s `-o FILE` would take as names.
KUBECTL_FORMATS = frozenset({"yaml", "json", "wide", "name"})


def kubernetes_command(
    docs: Sequence[tuple[str, dict[str, Any]]],
    *,
    fleet: str,
    image: str,
    output: str | None,
) -> int:
    """Validate `docs` as `apply` does, translate, write the YAML to `output` (None:
    stdout) and what did not translate to stderr."""
    if output in KUBECTL_FORMATS:
        # kubectl's `-o` names a format: `-o yaml` would write a file named yaml.
        raise errors.InvalidRequest(
            f"-o takes a FILE to write, not a format: export always writes YAML (to "
            f"stdout without -o); for a file named {output}, give -o ./{output}"
        )
    try:
        resources = manifests.validate_objects(docs, exists=lambda kind, name: False)
    except errors.ManifestInvalid as err:
        # Each object's errors with the file it came from, as `apply -f` shows them.
        raise errors.ManifestInvalid(manifests.locate(err.errors, docs)) from None
    files = {r.metadata.name: model_file(r) for r in resources if isinstance(r, Model)}
    result = kubernetes.export(resources, files=files, fleet=fleet, image=image)
    text = kubernetes.render(result)
    if output:
        try:
            Path(output).write_text(text, encoding="utf-8")
        except OSError as exc:
            raise errors.InvalidRequest(f"-o: cannot write {output}: {exc.strerror}") from None
    else:
        sys.stdout.write(text)
    print("Not translated (also in the output's header):", file=sys.stderr)
    for line in result.untranslated:
        print(f"  - {line}", file=sys.stderr)
    return 0


def model_file(model: Model) -> kubernetes.ModelFile:
    """What this host has of `model`'s GGUF: its header's figures and its size, or why
    not. Reads a header (tens of milliseconds), never a whole file."""
    try:
        path = _local_path(model)
    except SourceError as err:
        return kubernetes.ModelFile(missing=err.message)
    if path is None:
        return kubernetes.ModelFile(
            missing=f"package {model.spec.source.package} is not assembled on this host "
            "(a daemon serving it assembles it into the model cache)"
        )
    try:
        modelfile.check_magic(path)
        info = modelfile.read_gguf(path)
        size = path.stat().st_size
    except SourceError as err:
        return kubernetes.ModelFile(missing=err.message)
    except OSError as exc:
        return kubernetes.ModelFile(missing=f"{path} cannot be read: {exc.strerror}")
    shape = fit.ModelShape.of_parameters(info.parameters, size_bytes=size)
    missing = None if shape is not None else "its header lacks the figures of an estimate"
    return kubernetes.ModelFile(
        shape=shape,
        size_bytes=size,
        missing=missing,
        architecture=info.architecture,
        has_chat_template=info.parameters.get("has_chat_template") == "true",
    )


def _local_path(model: Model) -> Path | None:
    """The Model's file on this host, None when a package's is not assembled yet."""
    source = model.spec.source
    if source.path is not None:
        path = Path(source.path).expanduser()
        if not path.is_file():
            raise SourceError("FileNotFound", f"no file at {source.path}")
        return path
    assert source.package is not None
    module: Any = ModelSources.of([]).package(source.package)
    if not hasattr(module, "assemble"):
        package_dir = Path(module.__file__).parent
        found = sorted(package_dir.rglob("*.gguf"))
        return found[0] if len(found) == 1 else None
    # Where `modelfile.resolve` has the cache keep it: by digest, else by version.
    root = modelcache.default_root()
    filename = getattr(module, "MODEL_NAME", f"{source.package.replace('-', '_')}.gguf")
    digest = getattr(module, "EXPECTED_SHA256", None) or model.spec.sha256
    candidates = []
    if digest:
        candidates.append(root / "sha256" / digest / filename)
    try:
        version = importlib.metadata.version(source.package)
        candidates.append(root / "package" / source.package / version / filename)
    except importlib.metadata.PackageNotFoundError:
        pass
    return next((c for c in candidates if c.is_file()), None)
