"""Checks of real answers against Kiln's OpenAPI document (``GET /openapi.json``): JSON Schema
2020-12 validators for a schema inside the document, and whether a response is documented."""
from jsonschema import Draft202012Validator
from referencing import Registry
from referencing.jsonschema import DRAFT202012

DOC_URI = "urn:kiln:openapi"


def escape(token):
    """A JSON Pointer token (RFC 6901)."""
    return token.replace("~", "~0").replace("/", "~1")


def validator(document, pointer):
    """A 2020-12 validator for the schema at JSON Pointer ``pointer`` inside ``document``."""
    registry = Registry().with_resource(DOC_URI, DRAFT202012.create_resource(document))
    return Draft202012Validator({"$ref": f"{DOC_URI}#{pointer}"}, registry=registry)


def component(document, name):
    return validator(document, f"/components/schemas/{name}")


def media_pointer(path, method, status, media):
    return (f"/paths/{escape(path)}/{method}/responses/{status}/content/{escape(media)}")


def check_response(document, path, resp, method="get"):
    """Assert ``resp`` is documented: its status is listed for the operation, its media type
    too, and a JSON body validates against that response's schema."""
    responses = document["paths"][path][method]["responses"]
    status = str(resp.status_code)
    assert status in responses, f"{path} {status} is not documented"
    media = resp.headers["Content-Type"].split(";")[0].strip()
    assert media in responses[status]["content"]
    if media == "application/json":
        validator(document, media_pointer(path, method, status, media) + "/schema").validate(
            resp.json())
    return media
