"""Kiln: an OpenAI-compatible LLM API gateway with prepaid credits and exact metering."""
import logging

from flask import Flask, request

from .config import Config, environment


def create_app(config=None, environ=None):
    """Build the WSGI app.

    :param config: a :class:`Config`, a mapping of Config field names, or None for the
        ``KILN_*`` environment.
    :param environ: where the catalog's backend keys (``api_key_env``) are read; None: the
        process environment.
    """
    # The composition root: the one module that imports every layer.
    from .api import account, activity, auth, body_process, chat, cors, intake, openapi
    from .api import health as probes
    from .api import legacy, messages, responses
    from .api import models as model_list
    from .backends import fleet, health, upstream
    from .contract import catalog
    from .background import Background
    from .db import create_engine
    from .dialects.responses import ResponsesCodec
    from .errors import register_error_handlers
    from .flow.life import Services
    from .ledger import Ledger, NullLedger
    from .ops import lifecycle, metrics
    if not isinstance(config, Config):
        config = Config.from_mapping(config)
    app = Flask(__name__)
    app.config["KILN"] = config
    engine = create_engine(config)
    models = catalog.load_catalog(config.models,
                                  environment() if environ is None else environ)
    gauges = metrics.Metrics()
    states = fleet.prepare(models, config)
    # Chosen once: the benchmarks' unmetered baseline has no ledger at all (KILN_METERING).
    background = Background(lambda name: gauges.background_restarts.labels(name).inc())
    ledger = Ledger(create_engine(config, ledger=True), config, models, gauges, background) \
        if config.metering else NullLedger()
    services = Services(config=config, engine=engine,
                        session=upstream.create_session(config.upstream_pool_size),
                        catalog=models, metrics=gauges, ledger=ledger, states=states,
                        background=background)
    app.extensions.update({
        "kiln": services, "kiln.engine": engine, "kiln.catalog": services.catalog,
        "kiln.metrics": services.metrics, "kiln.key_cache": {}, "kiln.maintenance": {},
        "kiln.unknown_keys": {}, "kiln.key_used": {},
        "kiln.responses_codec": ResponsesCodec(config.responses_store_default),
        "kiln.parse_budget": intake.ParseBudget(config.parse_budget_bytes, config.parse_wait_s),
        "kiln.body_process": body_process.BodyProcess(config.models, config.max_body_bytes),
    })
    register_error_handlers(app)
    for blueprint in (auth.bp, chat.bp, messages.bp, responses.bp, legacy.bp, model_list.bp,
                      account.bp, activity.bp):
        app.register_blueprint(blueprint, url_prefix="/v1")
    app.register_blueprint(probes.bp)
    app.register_blueprint(openapi.bp)
    app.register_blueprint(activity.page)
    app.register_blueprint(metrics.bp)

    @app.before_request
    def _start_background():
        lifecycle.start_sweeper(app)
        health.start_prober(app)
        request.environ.setdefault("kiln.client_addr", client_address(config, request))

    # After the hook above, so that a preflight's log line has the client address.
    cors.init_app(app, config.cors_origins)
    logging.getLogger("kiln.requests").setLevel(logging.INFO)
    return app


def client_address(config, req):
    """Return the client's address, believing ``X-Forwarded-For`` only from trusted proxies."""
    peer = req.remote_addr
    forwarded = req.headers.get("X-Forwarded-For")
    if forwarded and peer in config.trusted_proxy_set:
        return forwarded.split(",")[-1].strip()
    return peer
