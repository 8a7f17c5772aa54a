"""Kiln: an OpenAI-compatible LLM API gateway with prepaid credits and exact metering."""
import logging

from flask import Flask, request

from .config import Config, environment


def create_app(config=None, environ=None):
    """Build the WSGI app: the composition root, the one place that imports every layer.

    :param config: a :class:`Config`, a mapping of Config field names, or None for the
        ``KILN_*`` environment.
    :param environ: where the catalog's backend keys (``api_key_env``) are read; None: the
        process environment.
    """
    from .api import body_process, cors, intake
    from .backends import health
    from .contract.image_hosts import HostResolver
    from .dialects.responses import ResponsesCodec
    from .ledger.history import HistoryCache
    from .ledger.responses import ResponseWriter
    from .errors import register_error_handlers
    from .ops import lifecycle, tracing, webhooks
    if not isinstance(config, Config):
        config = Config.from_mapping(config)
    app = Flask(__name__)
    app.config["KILN"] = config
    services = _services(config, environment() if environ is None else environ)
    app.extensions.update({
        "kiln": services, "kiln.engine": services.engine, "kiln.catalog": services.catalog,
        "kiln.metrics": services.metrics, "kiln.key_cache": {}, "kiln.maintenance": {},
        "kiln.unknown_keys": {}, "kiln.key_used": {},
        "kiln.responses_codec": ResponsesCodec(config.responses_store_default),
        "kiln.responses_writer": ResponseWriter(services.engine, config.db_pool_timeout_s + 1,
                                                services.background,
                                                services.ledger.admission_turn()),
        "kiln.responses_history": HistoryCache(config.responses_cache_mb * 1024 * 1024),
        "kiln.parse_budget": intake.ParseBudget(config.parse_budget_bytes, config.parse_wait_s),
        "kiln.body_process": body_process.BodyProcesses(config.models, config.max_body_bytes,
                                                        intake.PARSERS),
        "kiln.image_hosts": HostResolver(
            config.image_nameservers, config.image_resolve_timeout_s,
            config.image_lookups_per_worker, config.image_lookups_per_org,
            config.image_cache_size, config.image_cache_ttl_s, config.image_negative_ttl_s),
    })
    register_error_handlers(app)
    _register_blueprints(app)

    @app.before_request
    def _start_background():
        lifecycle.start_sweeper(app)
        health.start_prober(app)
        webhooks.start_deliverer(app)
        request.environ.setdefault("kiln.client_addr", client_address(config, request))

    # After the hook above, so that a preflight's log line has the client address.
    cors.init_app(app, config.cors_origins)
    logging.getLogger("kiln.requests").setLevel(logging.INFO)
    tracing.install(app, config)  # outermost: the request's span covers everything else
    return app


def _services(config, environ):
    """The per-app collaborators (:class:`gateway.flow.life.Services`): the engine, the catalog
    (backend keys read from ``environ``), the metrics, the backends' states, the ledger, the
    catalog's local tokenizers (built in the background from the worker's start)."""
    from .background import Background
    from .backends import fleet, upstream
    from .contract import catalog
    from .contract.tokenizers import LocalTokenizers
    from .db import create_engine
    from .flow.life import Services
    from .ledger import Ledger, NullLedger
    from .ops import metrics
    models, gauges = catalog.load_catalog(config.models, environ), metrics.Metrics()
    background = Background(lambda name: gauges.background_restarts.labels(name).inc())
    # Chosen once: the benchmarks' unmetered baseline has no ledger at all (KILN_METERING).
    ledger = Ledger(create_engine(config, ledger=True), config, models, gauges, background) \
        if config.metering else NullLedger()
    tokenizers = LocalTokenizers(
        {m.id: m.tokenizer for m in models.values() if m.tokenizer},
        on_failure=lambda model, reason: gauges.tokenize_failures.labels(model, reason).inc())
    if tokenizers.paths:
        background.spawn("tokenizers", tokenizers.warm)  # off the first requests' path
    return Services(config=config, engine=create_engine(config),
                    session=upstream.create_session(config.upstream_pool_size),
                    catalog=models, metrics=gauges, ledger=ledger,
                    states=fleet.prepare(models, config), background=background,
                    tokenizers=tokenizers)


def _register_blueprints(app):
    from .api import (account, activity, auth, chat, generations, keys, legacy, messages,
                      openapi, responses)
    from .api import health as probes
    from .api import models as model_list
    from .ops import metrics
    for blueprint in (auth.bp, chat.bp, messages.bp, responses.bp, legacy.bp, model_list.bp,
                      account.bp, activity.bp, generations.bp, keys.bp):
        app.register_blueprint(blueprint, url_prefix="/v1")
    for blueprint in (probes.bp, openapi.bp, activity.page, metrics.bp):
        app.register_blueprint(blueprint)


def client_address(config, req):
    """Return the client's address, believing ``X-Forwarded-For`` only from trusted proxies."""
    peer = req.remote_addr
    forwarded = req.headers.get("X-Forwarded-For")
    if forwarded and peer in config.trusted_proxy_set:
        return forwarded.split(",")[-1].strip()
    return peer
