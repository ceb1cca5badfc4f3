"""nbval settings for the teaching notebooks."""


def pytest_collectstart(collector):
    # stderr carries torch's C++ warnings (timestamps, host names) and launcher notices whose
    # timing varies; stdout, results and displayed summaries are what the notebooks assert.
    if collector.fspath and collector.fspath.ext == ".ipynb":
        collector.skip_compare += ("stderr",)
