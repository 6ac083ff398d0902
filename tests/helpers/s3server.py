"""A real S3 API on 127.0.0.1 for the object-storage checkpoint tests: moto's server (``moto[server]``), never
the internet. ``S3Server`` starts it on a free port and gives the environment a process needs to reach it
(dummy credentials, ``AWS_ENDPOINT_URL``, which botocore and so s3fs read)."""

from __future__ import annotations

import contextlib
import uuid
from typing import Dict, Iterator

from trainforge.strategies.environment import temporary_environ


class S3Server:
    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.env = self.dummy_env(self.endpoint)

    @staticmethod
    def dummy_env(endpoint: str) -> Dict[str, str]:
        """Dummy credentials and ``endpoint`` for botocore (and so s3fs)."""
        return {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint,
        }

    def fs(self):  # an s3fs filesystem talking to this server (tests inspect and tamper with the bucket)
        import s3fs

        return s3fs.S3FileSystem(
            key="testing", secret="testing", client_kwargs={"endpoint_url": self.endpoint}, use_listings_cache=False
        )

    def bucket(self) -> str:
        name = f"b-{uuid.uuid4().hex[:12]}"
        self.fs().mkdir(name)
        return name

    def stop(self) -> None:
        self._server.stop()

    @contextlib.contextmanager
    def environ(self) -> Iterator[None]:
        """This process's environment pointed at the server while inside (a context manager)."""
        with temporary_environ({**self.env, "AWS_PROFILE": None}):
            yield
