"""uvicorn's server, with a second signal that keeps the promise of the first: every
request still running gets a last event.

The first SIGINT or SIGTERM is uvicorn's graceful stop: no new connection, the running
requests finish, then the app's shutdown (the engine closes). uvicorn's second Ctrl-C would
drop the connections mid-answer (their tasks cancelled, a traceback each in the log, no
stream ending as the API says). Here a second SIGINT or SIGTERM instead ends every running
request at once through the app's `abort` (`create_app`'s `state.abort`): a stream gets an
error event as its last, a request that does not stream a 503; their connections then close
as any answer's do, and the stop goes on as after one signal. A third Ctrl-C is uvicorn's own.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Callable

import uvicorn


class Server(uvicorn.Server):
    """`uvicorn.Server` whose second stop signal aborts the running requests (module docstring).

    Args:
      config: the `uvicorn.Config`.
      abort: `abort(reason) -> count`: ends every request being answered with `reason`.
      say: prints one line of the command's own (what the second signal did).
    """

    def __init__(self, config: uvicorn.Config, abort: Callable[[str], int], say: Callable[[str], None]):
        super().__init__(config)
        self._abort, self._say = abort, say
        self._aborting, self._loop = False, None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit or self._aborting:
            super().handle_exit(sig, frame)
            return
        self._aborting = True  # (a signal handler runs between two bytecodes of the loop: the work goes to it)
        self._loop.call_soon_threadsafe(self._abort_running, signal.Signals(sig).name)

    def _abort_running(self, name: str) -> None:
        count = self._abort(f"the server is stopping at once ({name} during its graceful stop): this request was cut "
                            "short")
        self._say(f"{name} again: ended the {count} running request(s) at once, each with a last error event")
