from trainpilot.cli.main import run

run()
