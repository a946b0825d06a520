"""A module that starts a thread when imported: a fork server that imports it must stop forking
(tests/runtime/test_forkserver.py)."""

from __future__ import annotations

import threading
import time

threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
