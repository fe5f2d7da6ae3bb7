"""The calc-weather resource app; the code lives in ``rollcage.environments.calc_weather``.

The controller serves it on loopback when a row names ``calc-weather``. By hand::

    import uvicorn
    from rollcage.environments import create_app

    uvicorn.run(create_app("calc-weather"))
"""

from rollcage.environments.calc_weather import create_app

__all__ = ["create_app"]
