"""The soak (issue 11): a million keyed requests against the example, audited. See __main__.py."""
