"""`strata store`: write a model's manifest, push a model to S3, fetch a model URI.

    strata store manifest DIR
    strata store push DIR s3://bucket/prefix [--s3-endpoint-url URL]
    strata store fetch URI [--s3-endpoint-url URL]      prints the verified local path

S3 credentials come from boto3's usual chain (its environment variables, ~/.aws, instance roles).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from strata.commands.env import CliEnv


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("store", help="model storage: manifests, push to and fetch from S3")
    ssub = p.add_subparsers(dest="store_command", required=True,
                            metavar="{manifest,push,fetch}")
    manifest = ssub.add_parser("manifest", help="write strata-manifest.json (sha256 of each file)")
    manifest.add_argument("dir", type=Path)
    push = ssub.add_parser("push", help="upload a model directory and its manifest to S3")
    push.add_argument("dir", type=Path)
    push.add_argument("uri", help="s3://bucket/prefix")
    fetch = ssub.add_parser("fetch", help="download (s3://) and verify a model; print its path")
    fetch.add_argument("uri", help="a path, file:///abs/path or s3://bucket/prefix")
    for parser in (push, fetch):
        parser.add_argument("--s3-endpoint-url", default=None,
                            help="an S3-compatible server (default: AWS)")
        parser.add_argument("--s3-region", default=None)
        parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace, env: CliEnv) -> int:
    from strata.store import S3Config, push_dir, resolve_model_uri, write_manifest

    if args.store_command == "manifest":
        print(write_manifest(args.dir))
        return 0
    config = S3Config(endpoint_url=args.s3_endpoint_url, region_name=args.s3_region)
    if args.store_command == "push":
        manifest = push_dir(args.dir, args.uri, config, progress=not args.no_progress)
        print(f"pushed {len(manifest.files)} files ({manifest.total_bytes} bytes) to {args.uri}")
        return 0
    print(resolve_model_uri(args.uri, cache_dir=env.cache_dir, s3_config=config,
                            progress=not args.no_progress))
    return 0
