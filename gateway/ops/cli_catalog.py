"""``kiln catalog``: check a model catalog before it is applied (docs/ROUTING.md, "Drain and
reload")."""
import click

from ..contract import tokenizers
from ..contract.catalog import CatalogError, load_catalog
from ..config import Config, environment


@click.group()
def catalog():
    """The model catalog (KILN_MODELS)."""


@catalog.command("check")
@click.argument("path", type=click.Path(dir_okay=False), required=False)
def catalog_check(path):
    """Validate a catalog (PATH, else KILN_MODELS's) before a reload; exit status 1 and the
    reason if it is not valid. Local tokenizers are built too (a worker builds them after its
    start: a vocabulary Kiln cannot rebuild would leave the model to the bound)."""
    if path is None:
        path = Config.from_mapping().models
    try:
        models = load_catalog(path, environment())  # the backends' keys can be read too
        for entry in models.values():
            if entry.tokenizer:
                tokenizers.load(entry.tokenizer)
    except (CatalogError, tokenizers.TokenizerFileError) as err:
        raise click.ClickException(str(err)) from err
    for entry in models.values():
        live = sum(1 for b in entry.backends if b.weight > 0)
        drained = len(entry.backends) - live
        click.echo(f"{entry.id}: {live} in rotation, {drained} drained, routing {entry.routing}")
        if not live:
            click.echo(f"warning: every backend of {entry.id} is drained (503 for it)", err=True)
    click.echo(f"ok: {len(models)} models")
