"""A real S3-compatible server on loopback for the tests: moto's standalone server
(``moto[server]``'s ThreadedMotoServer, real HTTP, real s3fs/botocore clients; nothing is
mocked in the client), one bucket, test credentials in the environment."""
from __future__ import annotations

import os
import uuid

BUCKET = "dckpt-tests"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


class S3Server:
    """``start()`` binds a free loopback port; ``endpoint`` is its URL."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.endpoint = ""

    def start(self) -> "S3Server":
        import logging

        import boto3

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request

        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        os.environ.update(CREDENTIALS)
        boto3.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=BUCKET)
        return self

    def stop(self) -> None:
        self.server.stop()

    def url(self, name: str = "") -> str:
        """A fresh prefix in the bucket, as an s3:// URL."""
        return f"s3://{BUCKET}/{name or 't'}-{uuid.uuid4().hex[:12]}"

    @property
    def options(self) -> dict:
        """storage_options that reach this server."""
        return {"endpoint_url": self.endpoint}
