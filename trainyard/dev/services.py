"""The servers under a ``dev up``: the embedded PostgreSQL (or the one a URL names) and its
migrations, the embedded S3 (``weed mini``, or the endpoint given, its bucket checked over TLS with
the CA given)."""

from __future__ import annotations

from trainyard.dev.base import ClusterBase
from trainyard.dev.config import DevError
from trainyard.dev.processes import s3_credentials
from trainyard.embedded import LOOPBACK, EmbeddedError, EmbeddedPostgres, EmbeddedS3
from trainyard.protocol.s3tls import split_endpoint, tls_context, tls_failure


class EmbeddedServices(ClusterBase):
    """Starting PostgreSQL and S3 and making the database and the bucket ready."""

    def _start_postgres(self) -> None:
        cfg = self.config
        self._say(f"starting PostgreSQL (data: {cfg.data_dir / 'postgres'})")
        try:
            self.pg = EmbeddedPostgres(cfg.data_dir / "postgres", database="trainyard")
        except EmbeddedError as exc:
            raise DevError(str(exc).splitlines()[0]) from exc
        self.database_url = self.pg.url

    def _migrate(self) -> None:
        self._say("applying database migrations")
        try:
            from control_plane.db import run_migrations
        except ImportError as exc:
            raise DevError(f"the control plane cannot be imported ({exc}); is the package installed?") from exc
        try:
            run_migrations(self.database_url)
        except Exception as exc:
            raise DevError(f"database migrations failed: {' '.join(str(exc).split())[:300]}") from exc

    def _start_s3(self) -> tuple[str, str, str]:
        cfg = self.config
        if cfg.s3_endpoint is not None:
            assert cfg.s3_access_key and cfg.s3_secret_key
            self._ensure_bucket(cfg.s3_endpoint, cfg.s3_access_key, cfg.s3_secret_key)
            return cfg.s3_endpoint, cfg.s3_access_key, cfg.s3_secret_key
        access, secret = s3_credentials(cfg.data_dir / "s3-credentials.json")
        self._say(f"starting S3 (SeaweedFS; data: {cfg.data_dir / 's3'})")
        try:
            self.s3 = EmbeddedS3(
                cfg.data_dir / "s3",
                host=cfg.host if self.network is not None else LOOPBACK,  # --netns: where the nodes reach it
                access_key=access,
                secret_key=secret,
                bucket=cfg.s3_bucket,
                log_path=self.logs_dir / "s3.log",
            )
        except EmbeddedError as exc:
            raise DevError(f"{str(exc).splitlines()[0]} (log: {self.logs_dir / 's3.log'})") from exc
        return self.s3.endpoint, access, secret

    def _ensure_bucket(self, endpoint: str, access: str, secret: str) -> None:
        import urllib3

        from trainyard.embedded.s3 import S3Endpoint

        host_port, secure = split_endpoint(endpoint)
        # Few retries: an untrusted certificate or a wrong address does not get better with them.
        http = urllib3.PoolManager(retries=urllib3.Retry(total=2, backoff_factor=0.2),
                                   ssl_context=tls_context(str(self.config.s3_ca_file or "")))
        client = S3Endpoint(endpoint=host_port, access_key=access, secret_key=secret,
                            secure=bool(secure)).client(http_client=http)
        try:
            if not client.bucket_exists(self.config.s3_bucket):
                client.make_bucket(self.config.s3_bucket)
        except Exception as exc:
            why = tls_failure(exc, endpoint) or ' '.join(str(exc).split())[:200]
            raise DevError(f"S3 at {endpoint} is not usable: {why}") from exc
