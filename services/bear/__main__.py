from bear.cli import main

main()
