"""The calc-weather resource app; the code lives in ``rollcage.environments.calc_weather``.

Serve it by hand with ``uvicorn --factory examples.calc-weather.app:create_app`` is not
possible (the directory name has a dash); use
``python -c "import uvicorn; from rollcage.environments.calc_weather import create_app; uvicorn.run(create_app())"``.
"""

from rollcage.environments.calc_weather import create_app

__all__ = ["create_app"]
