#!/usr/bin/env python3
"""Writes the Wasm module as an OCI image archive (an OCI image layout in one tar), without a
container engine: the image envoy/oci/Dockerfile describes (one layer holding the module as
plugin.wasm at its root, the form Istio's WasmPlugin accepts), tagged with the release's version.

    scripts/oci-image.py MODULE VERSION REVISION OUT.tar

Push it with any OCI tool, e.g. `skopeo copy oci-archive:OUT.tar:VERSION docker://REGISTRY/idemgate:VERSION`.
Byte-for-byte reproducible: every timestamp is 0, every owner root, every JSON sorted.
"""
import gzip
import hashlib
import io
import json
import sys
import tarfile


def tar_of(files):
    """A deterministic tar of {name: bytes}."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime, info.uid, info.gid = len(data), 0o644, 0, 0, 0
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def blob(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def canonical(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def main():
    module_path, version, revision, out = sys.argv[1:5]
    module = open(module_path, "rb").read()
    layer_tar = tar_of({"plugin.wasm": module})
    gz = io.BytesIO()
    with gzip.GzipFile(fileobj=gz, mode="wb", mtime=0, filename="") as g:
        g.write(layer_tar)
    layer = gz.getvalue()
    labels = {
        "org.opencontainers.image.title": "idemgate",
        "org.opencontainers.image.version": version,
        "org.opencontainers.image.revision": revision,
    }
    config = canonical({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Labels": labels},
        "rootfs": {"type": "layers", "diff_ids": [blob(layer_tar)]},
    })
    manifest = canonical({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": blob(config), "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": blob(layer), "size": len(layer)}],
        "annotations": labels,
    })
    index = canonical({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": blob(manifest),
            "size": len(manifest),
            "annotations": {"org.opencontainers.image.ref.name": version},
        }],
    })
    files = {"oci-layout": canonical({"imageLayoutVersion": "1.0.0"}), "index.json": index}
    for data in (layer, config, manifest):
        files["blobs/sha256/" + blob(data)[len("sha256:"):]] = data
    with open(out, "wb") as f:
        f.write(tar_of(files))
    print(f"oci: {out} (tag {version}, manifest {blob(manifest)})")


if __name__ == "__main__":
    main()
