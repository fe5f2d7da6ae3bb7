"""The nemo-counter resource server; the code lives in ``rollcage.environments.counter``.

The controller serves it on loopback for ``--environment nemo-counter``. To serve it
by hand (then pass ``--environment http://127.0.0.1:8123``)::

    python examples/nemo-counter/app.py --port 8123
"""

import argparse

from rollcage.environments.counter import create_app

__all__ = ["create_app"]

if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8123)
    args = parser.parse_args()
    uvicorn.run(create_app(), host=args.host, port=args.port)
