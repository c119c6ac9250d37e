"""This plugin's scheduler and KV cache pass llmserve's conformance kit: a few lines each."""

import llmserve_example_plugin
from llmserve.testing import check_allocator, check_scheduler
from llmserve_example_plugin.simple_cache import SimplePrefixCache


def test_the_simple_cache_conforms():
    check_allocator(SimplePrefixCache)


def test_the_sjf_scheduler_conforms():
    check_scheduler({"scheduler": {"name": "sjf"}}, plugins=[llmserve_example_plugin])


def test_the_sjf_scheduler_with_priorities_on_the_simple_cache_conforms():
    check_scheduler({"scheduler": {"name": "sjf", "options": {"respect_priority": True}}, "cache": {"name": "simple"}},
                    plugins=[llmserve_example_plugin], priorities=True)
