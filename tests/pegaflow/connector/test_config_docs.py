from pathlib import Path

from pegaflow.connector.config import ENV_VARS

CONFIGURATION_MD = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def test_connector_options_docs_table_lists_every_option_with_its_env_var():
    # docs/configuration.md's connector table cannot drift from the code: a row per option, its variable beside it.
    docs = CONFIGURATION_MD.read_text()
    for key, env in ENV_VARS.items():
        assert f"| `{key}` | `{env}` |" in docs, key
