"""The `local` transport: the same operations on this machine, through the same shell semantics."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from .base import TIMED_OUT, TIMED_OUT_NOTE, Stream, Transport


class LocalTransport(Transport):
    def _home_dir(self) -> str:
        return str(Path.home())

    def _exec(self, command, stdin, timeout):
        # bash -c in the home directory, like sshd running the login shell for a command.
        try:
            proc = subprocess.run(
                ["bash", "-c", command],
                input=stdin if stdin is not None else b"",
                capture_output=True,
                timeout=timeout,
                cwd=self.abspath("~"),
                # Like a command over SSH, out of the terminal's reach: Ctrl-C is the controller's to handle (a job's
                # start finishes or is undone, see jobs/direct.py start); it never kills ops.jobs between a start and its answer.
                start_new_session=True,
            )
        except subprocess.TimeoutExpired as e:  # as over SSH: an exit status, not a traceback (base.TIMED_OUT)
            return TIMED_OUT, e.stdout or b"", (e.stderr or b"") + TIMED_OUT_NOTE
        return proc.returncode, proc.stdout, proc.stderr

    def stream(self, command: str) -> Stream:
        proc = subprocess.Popen(
            ["bash", "-c", command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, cwd=self.abspath("~"),
            start_new_session=True,
        )

        def chunks():
            while True:
                data = proc.stdout.read1(65536)
                if not data:
                    return
                yield data

        def close():
            if proc.poll() is None:
                proc.terminate()
            proc.wait()
            proc.stdout.close()

        return Stream(chunks(), close, proc.poll)

    def write_bytes(self, path, data, mode=None):
        path = self.abspath(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if mode is not None:
            os.chmod(path, mode)

    def upload_fileobj(self, fileobj, path, mode=None):
        path = self.abspath(path)
        with open(path, "wb") as dst:
            shutil.copyfileobj(fileobj, dst, 1 << 20)
        if mode is not None:
            os.chmod(path, mode)

    def rename(self, src, dst):
        os.replace(self.abspath(src), self.abspath(dst))

    def read_bytes(self, path, offset=0):
        with open(self.abspath(path), "rb") as f:
            f.seek(offset)
            return f.read()

    def exists(self, path):
        return os.path.exists(self.abspath(path))

    def makedirs(self, path):
        os.makedirs(self.abspath(path), exist_ok=True)
